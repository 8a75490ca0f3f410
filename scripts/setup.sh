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
    # llama-cpp-python compiles llama.cpp (4-40 min the first time); pip caches the wheel.
    # Built for this CPU (GGML_NATIVE) without AMX: ggml's AMX products segfault on some
    # Sapphire Rapids machines, ours among them (llama.cpp issue 20824; docs/KERNELS.md).
    amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    export CMAKE_ARGS="${CMAKE_ARGS:-} '-DCMAKE_C_FLAGS=$amx_off' '-DCMAKE_CXX_FLAGS=$amx_off'"
    python -m pip install -q -e ".[test]"
else
    python -m pip install -q -e .
fi
