#!/usr/bin/env bash
# Creates .venv and installs moeswap into it. `scripts/setup.sh test` adds what the tests need.
# torch is pinned to the CPU build that lies on our machines' disk; a bare `torch` would pull
# a multi-GB CUDA build. Users with a GPU install their own torch (>= 2.4) first.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "test" ]; then
    # llama-cpp-python compiles llama.cpp (30-40 min the first time); pip caches the wheel.
    python -m pip install -q -e ".[test]"
else
    python -m pip install -q -e .
fi
