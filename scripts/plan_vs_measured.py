"""Predicted (``moeswap plan``) versus measured (``moeswap run``) decode tokens/s at a few budgets.

    python scripts/plan_vs_measured.py                      # the shipped trained model
    python scripts/plan_vs_measured.py --gb 2.2             # + a generated >= 2 GB model
    python scripts/plan_vs_measured.py --profile prof.json  # hit rates from a routing profile

For each model and each host budget (shared weights + KV cache + staging + a share of the routed
experts), the plan's prediction is computed from the file's header and the run is a fresh
``moeswap run`` subprocess with cold reads (``--cold-reads``: the disk tier is the disk, not the
page cache), greedy, one thread. A row passes when the prediction is within +-25 % of the
measurement. Run it on a quiet machine: a benchmark, not a test. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "moeswap" / "data" / "stdlib-moe-q8_0.gguf"
PROMPT = "def parse_args(argv):\n    "
TOLERANCE = 0.25


def measured_decode(model: Path, host_bytes: int, n_predict: int, threads: int,
                    profile: str | None) -> tuple[float, str]:
    """(decode tokens/s, the store's stats line) of one ``moeswap run``."""
    args = [sys.executable, "-m", "moeswap", "run", str(model), "-p", PROMPT, "-n", str(n_predict),
            "--temp", "0", "--threads", str(threads), "--host-mem", str(host_bytes), "--cold-reads"]
    if profile:
        args += ["--policy", f"pinned:{profile}"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=True)
    speed = re.search(r"decode: \d+ tokens, ([\d.]+) tokens/s", done.stderr)
    stats = next((line for line in done.stderr.splitlines() if line.startswith("experts:")), "")
    return float(speed.group(1)), stats


def rows_for(model: Path, shares: list[float], n_predict: int, threads: int,
             profile: str | None) -> list[str]:
    from moeswap.planner import plan_model
    from moeswap.planner.placement import Budget
    from moeswap.planner.rates import plan_rates

    context = len(PROMPT.encode()) + 1 + n_predict  # what `moeswap run` charges the store for
    rates = plan_rates({})
    probe = plan_model(model, Budget(0, 1 << 50, context), rates, profile).moeswap
    base = probe.host_charged
    rows = []
    for share in shares:
        host = base + int(share * probe.sizes.routed_bytes)
        plan = plan_model(model, Budget(0, host, context), rates, profile).moeswap
        measured, stats = measured_decode(model, host, n_predict, threads, profile)
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
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".bench",
                        help="where the generated model is written once (.bench)")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.5, 1.0],
                        help="routed-expert shares of the host budget (0.1 0.5 1.0)")
    parser.add_argument("-n", "--n-predict", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", help="a routing profile of the shipped model")
    args = parser.parse_args()
    print(f"rates: {__import__('moeswap.planner.rates', fromlist=['x']).plan_rates({}).source}")
    print("| model | expert share | --host-mem MiB | predicted hit rate | predicted tok/s | "
          "measured tok/s | error | store stats |")
    print("|---|---|---|---|---|---|---|---|")
    rows = rows_for(SHIPPED, args.shares, args.n_predict, args.threads, args.profile)
    if args.gb:
        spec = importlib.util.spec_from_file_location("offload_check",
                                                      ROOT / "scripts" / "offload_check.py")
        offload_check = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(offload_check)
        big = offload_check.generated_model(args.work_dir, args.gb)
        rows += rows_for(big, args.shares, args.n_predict, args.threads, None)
    return 0 if all("PASS" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
