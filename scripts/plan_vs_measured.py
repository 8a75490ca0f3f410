"""Predicted (``moeswap plan``) versus measured (``moeswap run``) decode tokens/s at a few budgets.

    python scripts/plan_vs_measured.py --gb 2.2 --prepare   # once, without the bench lock
    flock /tmp/moeswap-bench.lock python scripts/plan_vs_measured.py --gb 2.2 --refresh-probe

Models: the shipped trained model and, with ``--gb``, a generated Mixtral-shaped Q8_0 model that
big (scripts/bench_decode.py's writer; kept in --work-dir, written under a temporary name and
renamed). The generated model's random weights route near-uniformly, and that is the routing
measured.

For each model a routing trace is recorded first from a run on a different prompt than the
measured one (``moeswap run --trace``, as long as the measured run): the plan's hit rates come
from it (``moeswap plan --profile TRACE.npz``: the store's LRU replayed over it), and the
measured runs use the store's default policy, LRU. ``--prepare`` only writes the generated model
and the traces (untimed). ``--refresh-probe`` measures this machine's rates and fixed costs again
(``moeswap probe --refresh``, the runs' thread count) before anything is timed: the plan is
calibrated from the probe only.

For each host budget (shared weights + KV cache + staging + a share of the routed experts), the
plan's prediction is computed from the file's header, the model file is dropped from the page
cache, and the run is a fresh ``moeswap run`` subprocess with cold reads (``--cold-reads``: the
disk tier is the disk), greedy, one thread. A row passes when the prediction is within +-25 % of
the measurement. A benchmark for a quiet machine, not a test. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "moeswap" / "data" / "stdlib-moe-q8_0.gguf"
PROMPT = "def parse_args(argv):\n    "
# the trace's text: other code, so the measured run's routing is not the trace's own
PROFILE_PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push("
TOLERANCE = 0.25


def moeswap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswap", *args], capture_output=True,
                          text=True, cwd=ROOT, check=True)


def generated_model(work_dir: Path, gb: float) -> Path:
    spec = importlib.util.spec_from_file_location("bench_decode",
                                                  ROOT / "scripts" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = bench.mixtral_shape(gb, tiny=False)
    path = work_dir / (f"mixtral-shaped-q8_0-{shape['n_layer']}x{shape['n_embd']}x"
                       f"{shape['n_ff']}x{shape['n_expert']}.gguf")
    if not path.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        bench.write_mixtral(partial, shape)
        partial.rename(path)
    return path


def trace_for(model: Path, work_dir: Path, n_predict: int) -> Path:
    """A routing trace of a run on PROFILE_PROMPT (kept; a retrained model gets a new one)."""
    stat = model.stat()
    trace = work_dir / f"{model.stem}-{stat.st_size}-{stat.st_mtime_ns}-n{n_predict}.trace.npz"
    if not trace.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        partial = trace.with_name(f"{os.getpid()}.{trace.name}")
        moeswap("run", str(model), "-p", PROFILE_PROMPT, "-n", str(n_predict), "--temp", "0",
                "--trace", str(partial))
        partial.rename(trace)
    return trace


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measured_decode(model: Path, host_bytes: int, n_predict: int,
                    threads: int) -> tuple[float, str]:
    """(decode tokens/s, the store's stats line) of one ``moeswap run`` (default policy: LRU)."""
    drop_from_page_cache(model)
    done = moeswap("run", str(model), "-p", PROMPT, "-n", str(n_predict), "--temp", "0",
                   "--threads", str(threads), "--host-mem", str(host_bytes), "--cold-reads")
    speed = re.search(r"decode: \d+ tokens, ([\d.]+) tokens/s", done.stderr)
    stats = next((line for line in done.stderr.splitlines() if line.startswith("experts:")), "")
    return float(speed.group(1)), stats


def rows_for(model: Path, trace: Path, shares: list[float], n_predict: int,
             threads: int) -> list[str]:
    from moeswap.planner import plan_model
    from moeswap.planner.placement import Budget
    from moeswap.planner.rates import plan_rates

    context = len(PROMPT.encode()) + 1 + n_predict  # what `moeswap run` charges the store for
    rates = plan_rates({}, threads=str(threads))
    floor = plan_model(model, Budget(0, 1 << 50, context), rates).moeswap
    rows = []
    for share in shares:
        host = floor.host_charged + int(share * floor.all_experts) * floor.sizes.slot_bytes
        plan = plan_model(model, Budget(0, host, context), rates, str(trace)).moeswap
        measured, stats = measured_decode(model, host, n_predict, threads)
        predicted = plan.decode_tokens_per_second
        error = predicted / measured - 1
        verdict = "PASS" if abs(error) <= TOLERANCE else "FAIL"
        rows.append(f"| {model.name} | {share:.0%} | {host / 2**20:.1f} | {plan.hits.total:.1%} | "
                    f"{predicted:.2f} | {measured:.2f} | {error:+.0%} {verdict} | {stats} |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, help="also a generated Mixtral-shaped model this big")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/moeswap-models"),
                        help="where the generated model and the traces are kept")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.5, 1.0],
                        help="routed-expert shares of the host budget (0.1 0.5 1.0)")
    parser.add_argument("-n", "--n-predict", type=int, default=64)
    parser.add_argument("--gen-n-predict", type=int, default=16,
                        help="tokens decoded on the generated model (16)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prepare", action="store_true",
                        help="only write the generated model and the traces")
    parser.add_argument("--refresh-probe", action="store_true",
                        help="measure the probe's rates and fixed costs again first")
    args = parser.parse_args()
    models = [(SHIPPED, args.n_predict)]
    if args.gb:
        models.append((generated_model(args.work_dir, args.gb), args.gen_n_predict))
    traces = [trace_for(model, args.work_dir, n_predict) for model, n_predict in models]
    if args.prepare:
        return 0
    from moeswap.experts.probe import cached_overheads, cached_rates
    from moeswap.planner.rates import plan_rates

    cached_rates(args.threads, refresh=args.refresh_probe)
    print(f"fixed costs: {cached_overheads(args.threads, refresh=args.refresh_probe)}")
    print(f"rates: {plan_rates({}, threads=str(args.threads)).source}")
    print("| model | expert share | --host-mem MiB | predicted hit rate | predicted tok/s | "
          "measured tok/s | error | store stats |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for (model, n_predict), trace in zip(models, traces):
        rows += rows_for(model, trace, args.shares, n_predict, args.threads)
    return 0 if all("PASS" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
