#!/usr/bin/env bash
# Sets up .venv and runs the main job on the built-in model (docs/MODEL.md): a completion with
# a RAM budget that holds only some of its routed experts (the rest are read from the file when
# the router asks), the expert store's statistics, and the routing heatmap in results/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
mkdir -p results
moeswap run -p "def fibonacci(n):" -n 64 --temp 0 --host-mem 10MiB --trace results/quickstart-trace.npz
moeswap stats results/quickstart-trace.npz --plots results/
