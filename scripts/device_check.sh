#!/usr/bin/env bash
# The GPU device tier measured on a lent GPU machine (docs/OFFLOAD.md, "The GPU device tier").
#
#   bash scripts/device_check.sh --prepare   # HERE, with PyPI: fill .device_carry/ (gitignored)
#   bash scripts/device_check.sh             # THERE, no network: carry .device_carry along
#   bash scripts/device_check.sh --device cpu --quick   # the same steps on CPU tensors (dry run)
#
# The GPU machine has Python 3.12 with torch (CUDA), no network, no gguf and no
# llama-cpp-python. Our CPU kernels are ggml from llama-cpp-python (docs/KERNELS.md), and the
# check compares the device tier with them, so llama-cpp-python is built THERE (16 cores, about
# two minutes) from a carried sdist, CPU only (-DGGML_CUDA=off). PyPI's sdist is 73 MiB, over
# the 64 MiB a call may carry: --prepare repacks it without what the CPU build never reads
# (llama.cpp's .git, vocab models, docs, tests, tools, and the sources of the other ggml
# backends), about 4 MiB. gguf and diskcache (which llama_cpp imports) travel as wheels, and
# so do the build's own tools (scikit-build-core, cmake, ninja: no network there to fetch them).
#
# Everything else goes into an isolated venv that sees the machine's torch: a venv made with
# --system-site-packages from a python that is itself a venv (/opt/torch/.venv there) would see
# the base interpreter's packages, not torch's, so the torch site-packages is added by a .pth.
# Results: $OUT/device_check.md, .json and .log (/tmp/moeswap-device-check without $OUT).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CARRY="${MOESWAP_DEVICE_CARRY:-$ROOT/.device_carry}"
LLAMA_CPP_VERSION=0.3.36  # pyproject.toml's pin
GGUF_VERSION=0.19.0
DISKCACHE_VERSION=5.6.3

prepare() {
    mkdir -p "$CARRY"
    local work
    work="$(mktemp -d)"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$CARRY" \
        "gguf==$GGUF_VERSION" "diskcache==$DISKCACHE_VERSION"
    # The build backend and its tools: the GPU machine cannot fetch them (about 31 MiB, cmake's).
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$CARRY/build" \
        "scikit-build-core[pyproject]>=0.9.2" cmake ninja
    python3 -m pip download -q --no-deps --no-binary=:all: -d "$work" \
        "llama-cpp-python==$LLAMA_CPP_VERSION"
    local name="llama_cpp_python-$LLAMA_CPP_VERSION"
    tar -xzf "$work/$name.tar.gz" -C "$work"
    local v="$name/vendor/llama.cpp"
    # A CPU build of llama-cpp-python with LLAVA_BUILD=off reads none of these.
    (cd "$work" && tar -czf "$CARRY/$name-cpu.tar.gz" \
        --exclude="$name/.git" --exclude="$name/examples" --exclude="$name/docs" \
        --exclude="$v/models" --exclude="$v/docs" --exclude="$v/tests" --exclude="$v/benches" \
        --exclude="$v/media" --exclude="$v/gguf-py" --exclude="$v/examples" \
        --exclude="$v/tools" --exclude="$v/pocs" --exclude="$v/.github" \
        --exclude="$v/conversion" \
        --exclude="$v/ggml/src/ggml-cuda" --exclude="$v/ggml/src/ggml-vulkan" \
        --exclude="$v/ggml/src/ggml-sycl" --exclude="$v/ggml/src/ggml-opencl" \
        --exclude="$v/ggml/src/ggml-hexagon" --exclude="$v/ggml/src/ggml-metal" \
        --exclude="$v/ggml/src/ggml-et" --exclude="$v/ggml/src/ggml-webgpu" \
        --exclude="$v/ggml/src/ggml-openvino" --exclude="$v/ggml/src/ggml-cann" \
        --exclude="$v/ggml/src/ggml-virtgpu" \
        "$name")
    rm -rf "$work"
    du -sh "$CARRY"/*
    echo "carry it: run(carry=[\".device_carry\"], command=\"bash scripts/device_check.sh\")"
}

# The venv: carried wheels and the llama-cpp-python build, over the machine's own torch.
setup_venv() {
    local venv="$1"
    local torch_site
    torch_site="$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
    if ! python3 -m venv --system-site-packages "$venv" 2>/dev/null; then
        rm -rf "$venv"  # an interpreter without ensurepip: pip is driven from outside
        python3 -m venv --system-site-packages --without-pip "$venv"
    fi
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$torch_site" > "$site/_machine_torch.pth"
    pip_venv() {
        if [ -x "$venv/bin/pip" ]; then "$venv/bin/python" -m pip "$@"
        else python3 -m pip --python "$venv/bin/python" "$@"; fi
    }
    pip_venv install -q --no-index --no-deps --no-compile "$CARRY"/gguf-*.whl \
        "$CARRY"/diskcache-*.whl
    if ! "$venv/bin/python" -c 'import llama_cpp' 2>/dev/null; then
        echo "building llama-cpp-python $LLAMA_CPP_VERSION (CPU only) ..."
        pip_venv install -q --no-index --find-links "$CARRY/build" \
            "scikit-build-core[pyproject]>=0.9.2" cmake ninja
        CMAKE_ARGS="-DGGML_CUDA=off -DLLAVA_BUILD=off -DGGML_NATIVE=on" \
        CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
            pip_venv install -q --no-index --no-deps --no-build-isolation \
            "$CARRY/llama_cpp_python-$LLAMA_CPP_VERSION-cpu.tar.gz"
    fi
    "$venv/bin/python" -c 'import torch, gguf, llama_cpp; print("venv: torch", torch.__version__,
"cuda", torch.cuda.is_available(), "| gguf", gguf.__file__, "| llama_cpp", llama_cpp.__version__)'
}

main() {
    if [ "${1:-}" = "--prepare" ]; then
        prepare
        return
    fi
    local out="${OUT:-/tmp/moeswap-device-check}"
    mkdir -p "$out"
    local venv="${MOESWAP_DEVICE_VENV:-/tmp/moeswap-device-venv}"
    if python3 -c 'import gguf, llama_cpp' 2>/dev/null; then
        venv=""  # this python has everything already (a developer's machine)
    else
        setup_venv "$venv"
    fi
    local python="${venv:+$venv/bin/}python3"
    cd "$ROOT"
    PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT:$ROOT/tests:$ROOT/scripts" "$python" \
        scripts/device_check.py --markdown "$out/device_check.md" --json "$out/device_check.json" \
        "$@" 2>&1 | tee "$out/device_check.log"
}

main "$@"
