"""Predicted (``moeswap plan``) versus measured (``moeswap run``) decode tokens/s at a few budgets.

    python scripts/plan_vs_measured.py --generated mixtral-shaped-2.2gb-q8_0.gguf \
        --replay-routing humaneval.npz --plan-routing gsm8k.jsonl --prepare   # untimed, no lock
    flock /tmp/moeswap-bench.lock python scripts/plan_vs_measured.py --generated ... \
        --replay-routing humaneval.npz --plan-routing gsm8k.jsonl --refresh-probe

Models: the shipped trained model and, with ``--generated FILE`` (or ``--gb``: one written that
big by moeswap.bench.generated's writer into --work-dir), a generated Mixtral-shaped Q8_0 model.

The plan's hit rate comes from a routing trace of other text than the measured run (``moeswap
plan --profile TRACE.npz``: the store's LRU replayed over it); the measured runs use the store's
default policy, LRU, with prefetch off (the plan does not model prefetch). The shipped model:
the trace is ``moeswap trace`` of PLAN_PROMPTS (moeswap/bench/inputs/batch8_prompts.json less the one that
begins like PROMPT), each decoding as many tokens as a measured run, and the plan replays each
prompt from an empty cache, as a run starts; the measured runs decode PROMPT. The generated
model's random router spreads near-uniformly, so for realistic routing its measured runs replay
a recorded trace (``--replay-routing``, trace layer i driving MoE layer i) and the plan replays
another one (``--plan-routing``, .npz or the .jsonl `moeswap import-trace` reads, cut to the
model's MoE layers the same way); without them, its own routing on PLAN_PROMPTS.

After the timed runs, the measured prompt's own routing (``moeswap trace`` of PROMPT, untimed)
is replayed at each budget and printed beside the plan's hit rate: what the plan's input would
have been had the trace been the measured text itself (a reading, never an input).

``--prepare`` only writes the generated model and the traces (untimed). ``--refresh-probe``
measures this machine's rates and fixed costs again (``moeswap probe``, the runs' thread count)
before anything is timed: the plan is calibrated from the probe only.

For each host budget (shared weights + KV cache + a step's working memory + staging + a share
of the expert slots), the plan's prediction is computed from the file's header, the model file
is dropped from the page cache, and the run is a fresh ``moeswap run`` subprocess with cold
reads (``--cold-reads``: the disk tier is the disk), greedy, one thread; ``--repeats`` runs,
the fastest counting (the least disturbed by other work on the machine; all are printed, with
the load average before). A row passes when the prediction is within +-25 % of the measurement.
A benchmark for a quiet machine, not a test. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "moeswap" / "data" / "stdlib-moe-q8_0.gguf"
PROMPT = "def parse_args(argv):\n    "
# the plan's trace: seven varied beginnings of stdlib-style code, never the measured text (the
# batch's parse_args prompt begins like PROMPT, so it is left out)
PLAN_PROMPTS = [text for text in json.loads((ROOT / "moeswap" / "bench" / "inputs" / "batch8_prompts.json").read_text())
                ["prompts"] if not text.startswith(PROMPT.split("(")[0])]
TOLERANCE = 0.25
PROMPT_TOKENS = len(PROMPT.encode()) + 1  # what `moeswap run` charges for: a token per byte, BOS
# the runs' --step-tokens, which the plan is given too: the prompt in one forward (what run's
# default, 512, comes to for this prompt); plan and run then charge the same KV and step
STEP_TOKENS = PROMPT_TOKENS


@dataclass(frozen=True)
class Case:
    model: Path
    n_predict: int
    repeats: int  # measured runs per budget; the fastest is the least disturbed
    plan_trace: Path  # the plan's hit rates: the store's LRU replayed over it
    replay: Path | None = None  # the measured runs' routing, when not the model's own


def moeswap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswap", *args], capture_output=True,
                          text=True, cwd=ROOT, check=True)


def generated_model(work_dir: Path, gb: float) -> Path:
    from moeswap.bench.generated import cached_model, mixtral_shape

    shape = mixtral_shape(gb, tiny=False)
    return cached_model(work_dir, f"mixtral-shaped-q8_0-{shape['n_layer']}x{shape['n_embd']}x"
                                  f"{shape['n_ff']}x{shape['n_expert']}.gguf", shape)


def trace_for(model: Path, work_dir: Path, n_predict: int, prompts: list[str], name: str,
              threads: int) -> Path:
    """A routing trace of ``prompts``, each decoded greedily as ``moeswap run -n n_predict``
    decodes (n_predict - 1 tokens run after the prompt); kept, a retrained model gets a new one."""
    stat = model.stat()
    trace = work_dir / (f"{model.stem}-{stat.st_size}-{stat.st_mtime_ns}-{name}-n{n_predict}"
                        ".trace.npz")
    if not trace.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        partial = trace.with_name(f"{os.getpid()}.{trace.name}")
        moeswap("trace", str(model), *(arg for text in prompts for arg in ("-p", text)),
                "-n", str(n_predict - 1), "--threads", str(threads), "-o", str(partial))
        partial.rename(trace)
    return trace


def fitted_trace(source: Path, model: Path, work_dir: Path) -> Path:
    """``source`` (.npz, or .jsonl imported) cut to the model's MoE layers: trace layer i is MoE
    layer i, as ``--replay-routing`` maps them (kept in work_dir)."""
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.planner.sizes import model_sizes
    from moeswap.routing.traces import RoutingTrace

    gf = GGUFFile.open(model)
    try:
        layers = model_sizes(gf).moe_layers
    finally:
        gf.close()
    fitted = work_dir / f"{source.stem}-{len(layers)}layers.trace.npz"
    if fitted.exists():
        return fitted
    work_dir.mkdir(parents=True, exist_ok=True)
    if source.suffix != ".npz":
        imported = work_dir / f"{os.getpid()}.{source.stem}.npz"
        moeswap("import-trace", str(source), "-o", str(imported))
        source = imported
    trace = RoutingTrace.load(source)
    if source.parent == work_dir and source.name.startswith(f"{os.getpid()}."):
        source.unlink()  # the import, kept no longer than this
    n = len(layers)
    cut = RoutingTrace(model=trace.model, arch=trace.arch, layers=layers,
                       n_experts=trace.n_experts, k=trace.k, prompt_offsets=trace.prompt_offsets,
                       expert_ids=trace.expert_ids[:, :n], weights=trace.weights[:, :n],
                       phase=trace.phase, prompt_names=trace.prompt_names,
                       source=f"{trace.source}, first {n} layers")
    partial = work_dir / f"{os.getpid()}.{fitted.name}"
    cut.save(partial)
    partial.rename(fitted)
    return fitted


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages would stay
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measured_decode(case: Case, host_bytes: int, threads: int) -> tuple[list[float], str]:
    """(decode tokens/s of each of ``case.repeats`` ``moeswap run``s, the store's stats line);
    the default policy, LRU."""
    replay = ["--replay-routing", str(case.replay)] if case.replay else []
    speeds = []
    for _ in range(case.repeats):
        drop_from_page_cache(case.model)
        done = moeswap("run", str(case.model), "-p", PROMPT, "-n", str(case.n_predict), "--temp",
                       "0", "--threads", str(threads), "--host-mem", str(host_bytes),
                       "--step-tokens", str(STEP_TOKENS), "--cold-reads", "--prefetch", "off",
                       *replay)
        speeds.append(float(re.search(r"decode: \d+ tokens, ([\d.]+) tokens/s",
                                      done.stderr).group(1)))
    stats = next((line for line in done.stderr.splitlines() if line.startswith("experts:")), "")
    return speeds, stats


def budgets(case: Case, shares: list[float], threads: int) -> list[tuple[float, int, object]]:
    """(share, --host-mem bytes, the plan with ``case.plan_trace``'s hit rate) per share."""
    from moeswap.planner import plan_model
    from moeswap.planner.placement import Budget
    from moeswap.planner.rates import plan_rates

    context = PROMPT_TOKENS + case.n_predict  # what `moeswap run` charges the store
    rates = plan_rates({}, threads=str(threads))
    floor = plan_model(case.model, Budget(0, 1 << 50, context, 1, STEP_TOKENS), rates).moeswap
    hosts = [(share, floor.host_charged + int(share * floor.all_experts) * floor.sizes.slot_bytes)
             for share in shares]
    return [(share, host, plan_model(case.model, Budget(0, host, context, 1, STEP_TOKENS), rates,
                                     str(case.plan_trace)).moeswap) for share, host in hosts]


def rows_for(case: Case, shares: list[float], threads: int) -> list[str]:
    rows = []
    for share, host, plan in budgets(case, shares, threads):
        load = Path("/proc/loadavg").read_text().split()[0]
        speeds, stats = measured_decode(case, host, threads)
        measured = max(speeds)
        predicted = plan.decode_tokens_per_second
        error = predicted / measured - 1
        verdict = "PASS" if abs(error) <= TOLERANCE else "FAIL"
        rows.append(f"| {case.model.name} | {share:.0%} | {host / 2**20:.1f} | "
                    f"{plan.hits.total:.1%} | {predicted:.2f} | {measured:.2f} | "
                    f"{error:+.1%} {verdict} | {' '.join(f'{v:.2f}' for v in speeds)} | "
                    f"{load} | {stats} |")
        print(rows[-1], flush=True)
    return rows


def own_routing_readings(case: Case, shares: list[float], threads: int, work_dir: Path) -> None:
    """Untimed, after the runs: the hit rate of the measured prompt's own routing replayed at
    each budget, beside the plan's (a reading of the trace's representativeness, not an input)."""
    own = Case(case.model, case.n_predict, case.repeats,
               trace_for(case.model, work_dir, case.n_predict, [PROMPT], "measured-prompt",
                         threads))
    for (share, _, plan), (_, _, mine) in zip(budgets(case, shares, threads),
                                              budgets(own, shares, threads)):
        print(f"{case.model.name} {share:.0%}: plan's hit rate {plan.hits.total:.1%}, the "
              f"measured prompt's own routing replayed {mine.hits.total:.1%} "
              f"({mine.decode_tokens_per_second:.2f} tok/s with it)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generated", type=Path, help="also this generated model")
    parser.add_argument("--gb", type=float, help="or a generated Mixtral-shaped model this big")
    parser.add_argument("--replay-routing", type=Path,
                        help="a trace (.npz) whose routing the generated model's runs replay")
    parser.add_argument("--plan-routing", type=Path,
                        help="a trace of other text (.npz, .jsonl) for the generated model's plan")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/moeswap-models"),
                        help="where the generated model and the traces are kept")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.5, 1.0],
                        help="routed-expert shares of the host budget (0.1 0.5 1.0)")
    parser.add_argument("-n", "--n-predict", type=int, default=128,
                        help="tokens decoded on the shipped model, measured and traced (128)")
    parser.add_argument("--gen-n-predict", type=int, default=24,
                        help="tokens decoded on the generated model (24)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per budget on the shipped model; the fastest counts (3)")
    parser.add_argument("--gen-repeats", type=int, default=1,
                        help="runs per budget on the generated model (1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prepare", action="store_true",
                        help="only write the generated model and the traces")
    parser.add_argument("--refresh-probe", action="store_true",
                        help="measure the probe's rates and fixed costs again first")
    args = parser.parse_args()
    if bool(args.replay_routing) != bool(args.plan_routing):
        parser.error("--replay-routing and --plan-routing go together")
    cases = [Case(SHIPPED, args.n_predict, args.repeats,
                  trace_for(SHIPPED, args.work_dir, args.n_predict, PLAN_PROMPTS, "plan-prompts",
                            args.threads))]
    generated = args.generated or (generated_model(args.work_dir, args.gb) if args.gb else None)
    if generated and args.replay_routing:
        cases.append(Case(generated, args.gen_n_predict, args.gen_repeats,
                          fitted_trace(args.plan_routing, generated, args.work_dir),
                          args.replay_routing))
    elif generated:
        cases.append(Case(generated, args.gen_n_predict, args.gen_repeats,
                          trace_for(generated, args.work_dir, args.gen_n_predict, PLAN_PROMPTS,
                                    "plan-prompts", args.threads)))
    if args.prepare:
        return 0
    from moeswap.planner.probe import cached_overheads, cached_rates
    from moeswap.planner.rates import plan_rates

    cached_rates(args.threads, refresh=args.refresh_probe)
    print(f"fixed costs: {cached_overheads(args.threads, refresh=args.refresh_probe)}")
    print(f"rates: {plan_rates({}, threads=str(args.threads)).source}")
    print("| model | expert share | --host-mem MiB | predicted hit rate | predicted tok/s | "
          "measured tok/s (fastest) | error | each run | load before | store stats |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for case in cases:
        print(f"{case.model.name}: plan routing {case.plan_trace.name}; measured routing "
              f"{case.replay.name + ' replayed' if case.replay else 'its own'}", flush=True)
        rows += rows_for(case, args.shares, args.threads)
    for case in cases:
        if not case.replay:
            own_routing_readings(case, args.shares, args.threads, args.work_dir)
    return 0 if all("PASS" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
