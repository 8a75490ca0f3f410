#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test || exit 1
. .venv/bin/activate
# llama.cpp's own convert_hf_to_gguf.py is the reference for `moeswap convert`; it ships in the
# llama-cpp-python sdist. Fetch it once into a cache outside the repo (never committed).
reference=${XDG_CACHE_HOME:-$HOME/.cache}/moeswap/llama-cpp-python-0.3.36
if [ ! -f "$reference/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    tmp=$(mktemp -d)
    if python -m pip download -q --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d "$tmp"; then
        mkdir -p "$reference" && tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$reference" --strip-components=1
    fi
    rm -rf "$tmp"
fi
# The converter tests are core: without the reference they would skip, so stop here instead.
if [ ! -f "$reference/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    echo "cannot get llama.cpp's convert_hf_to_gguf.py (pip download of the llama-cpp-python" \
         "0.3.36 sdist failed): the converter tests need it" >&2
    exit 1
fi
# The web page's test drives Debian's headless Chromium (tests/test_web_page.py). It may skip
# only where chromium cannot be installed (tests/expected_skips.txt); say so when that happens.
if ! command -v chromedriver >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    fi
    command -v chromedriver >/dev/null || echo "chromium cannot be installed here (needs root and" \
        "apt: chromium chromium-driver): the browser tests (tests/test_web_page.py) will skip" >&2
fi
export MOESWAP_LLAMA_CPP_CONVERT="$reference/vendor/llama.cpp/convert_hf_to_gguf.py"
python -m pytest -q "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$status"
