"""``--suite plan``: the planner's figures beside what they describe (was
scripts/plan_vs_measured.py and scripts/plan_worked_cases.py).

    moeswap bench --suite plan measured [--gb 2.2 | --generated FILE] \\
        [--replay-routing humaneval.npz --plan-routing gsm8k.jsonl] --prepare -o DIR  # untimed
    flock /tmp/moeswap-bench.lock moeswap bench --suite plan measured [the same] \\
        --refresh-probe -o DIR
        predicted (the plan) versus measured decode tokens/s at a few host budgets
    moeswap bench --suite plan cases -o DIR
        the seeds' worked cases planned from header-only GGUFs of the real published shapes
        (moeswap.bench.suites.plan_cases)

``measured``: the built-in model (or ``--model``) and, with ``--generated FILE`` (or ``--gb``: one
written that big by moeswap.bench.generated's writer into --work-dir), a generated
Mixtral-shaped Q8_0 model. The plan's hit rate comes from a routing trace of other text than the
measured run (``moeswap plan --profile TRACE.npz``: the store's LRU replayed over it); the
measured runs use the store's default policy, LRU, with prefetch off (the plan does not model
prefetch). The built-in model: the trace is ``moeswap trace`` of plan_prompts() (the prompts of
moeswap/bench/inputs/batch8_prompts.json less the one that begins like PROMPT), each decoding as
many tokens as a measured run, and the plan replays each prompt from an empty cache, as a run
starts; the measured runs decode PROMPT. The generated model's random router spreads
near-uniformly, so for realistic routing its measured runs replay a recorded trace
(``--replay-routing``, trace layer i driving MoE layer i) and the plan replays another one
(``--plan-routing``, .npz or the .jsonl `moeswap import-trace` reads, cut to the model's MoE
layers the same way); without them, its own routing on plan_prompts(). After the timed runs, the
measured prompt's own routing (``moeswap trace`` of PROMPT, untimed) is replayed at each budget
and reported beside the plan's hit rate: what the plan's input would have been had the trace
been the measured text itself (a reading, never an input).

``--prepare`` only writes the generated model and the traces (untimed). ``--refresh-probe``
measures this machine's rates and fixed costs again (``moeswap probe``, the runs' thread count,
into --probe-cache) before anything is timed: the plan is calibrated from the probe only.

For each host budget (what the store charges -- moeswap.memory.HostCharge: shared weights, KV
cache, a step's working memory, staging -- plus a share of the expert slots), the plan's
prediction is computed from the file's header, and each run is `moeswap run` in a worker
(moeswap.bench.worker.run_call): the model file dropped from the page cache, cold reads (the
disk tier is the disk), greedy, prefetch off; ``--repeats`` runs, the fastest counting (the
least disturbed by other work on the machine; all are reported, with the load average before).
Each row also gives the host slots the plan counts beside those the store made. A row passes
when the prediction is within +-25 % of the measurement. A benchmark for a quiet machine, not
a test.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from moeswap.bench.environment import load_average
from moeswap.bench.worker import run_call
from moeswap.errors import MoeswapError

HERE = "moeswap.bench.suites.plan"
PROMPT = "def parse_args(argv):\n    "
TOLERANCE = 0.25
PROMPT_TOKENS = len(PROMPT.encode()) + 1  # what `moeswap run` charges for: a token per byte, BOS
# the runs' --step-tokens, which the plan is given too: the prompt in one forward (what run's
# default, 512, comes to for this prompt); plan and run then charge the same KV and step
STEP_TOKENS = PROMPT_TOKENS
BATCH8 = Path(__file__).resolve().parents[1] / "inputs" / "batch8_prompts.json"


def add_arguments(p) -> None:
    from moeswap.planner.probe import DEFAULT_CACHE

    p.add_argument("mode", choices=["measured", "cases"])
    p.add_argument("--model", help="measured: instead of the built-in model")
    p.add_argument("--generated", help="measured: also this generated model")
    p.add_argument("--gb", type=float,
                   help="measured: or a generated Mixtral-shaped model this big")
    p.add_argument("--replay-routing", help="a trace (.npz) whose routing the generated model's "
                                            "runs replay")
    p.add_argument("--plan-routing", help="a trace of other text (.npz, .jsonl) for the "
                                          "generated model's plan")
    p.add_argument("--work-dir", default="/tmp/moeswap-models",
                   help="where the generated model, the traces and the cases' headers are kept")
    p.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.5, 1.0],
                   help="routed-expert shares of the host budget (0.1 0.5 1.0)")
    p.add_argument("-n", "--n-predict", type=int, default=128,
                   help="tokens decoded on the built-in model, measured and traced (128)")
    p.add_argument("--gen-n-predict", type=int, default=24,
                   help="tokens decoded on the generated model (24)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per budget on the built-in model; the fastest counts (3)")
    p.add_argument("--gen-repeats", type=int, default=1,
                   help="runs per budget on the generated model (1)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prepare", action="store_true",
                   help="only write the generated model and the traces")
    p.add_argument("--refresh-probe", action="store_true",
                   help="measure the probe's rates and fixed costs again first")
    p.add_argument("--probe-cache", default=str(DEFAULT_CACHE),
                   help="the probe cache the plan is calibrated from (moeswap probe's)")
    p.add_argument("--timeout", type=float, default=1800, metavar="S")


@dataclass(frozen=True)
class Case:
    model: str
    n_predict: int
    repeats: int  # measured runs per budget; the fastest is the least disturbed
    plan_trace: str  # the plan's hit rates: the store's LRU replayed over it
    replay: str | None = None  # the measured runs' routing, when not the model's own


def plan_prompts() -> list[str]:
    """The plan's trace: seven varied beginnings of stdlib-style code, never the measured text
    (the batch's parse_args prompt begins like PROMPT, so it is left out)."""
    return [text for text in json.loads(BATCH8.read_text())["prompts"]
            if not text.startswith(PROMPT.split("(")[0])]


def trace_for(model: str, work_dir: Path, n_predict: int, prompts: list[str], name: str,
              threads: int) -> str:
    """A routing trace of ``prompts`` (`moeswap trace`, untimed), each decoded greedily as
    ``moeswap run -n n_predict`` decodes (n_predict - 1 tokens run after the prompt); kept, a
    retrained model gets a new one."""
    from moeswap.trace_capture import Prompt, record_trace

    stat = Path(model).stat()
    trace = work_dir / (f"{Path(model).stem}-{stat.st_size}-{stat.st_mtime_ns}-{name}-"
                        f"n{n_predict}.trace.npz")
    if not trace.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        partial = trace.with_name(f"{os.getpid()}.{trace.name}")
        record_trace(model, [Prompt(f"prompt-{i}", text) for i, text in enumerate(prompts)],
                     new_tokens=n_predict - 1, threads=threads).save(partial)
        partial.rename(trace)
    return str(trace)


def sizes_of(model: str):
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.planner.sizes import model_sizes

    gf = GGUFFile.open(model)
    try:
        return model_sizes(gf)
    finally:
        gf.close()


def fitted_trace(source: str, model: str, work_dir: Path) -> str:
    """``source`` (.npz, or imported) cut to the model's MoE layers: trace layer i is MoE layer
    i, as ``--replay-routing`` maps them (kept in work_dir)."""
    from moeswap.routing.importers import import_trace
    from moeswap.routing.traces import RoutingTrace

    layers = sizes_of(model).moe_layers
    fitted = work_dir / f"{Path(source).stem}-{len(layers)}layers.trace.npz"
    if fitted.exists():
        return str(fitted)
    trace = RoutingTrace.load(source) if source.endswith(".npz") else import_trace(source)
    n = len(layers)
    cut = RoutingTrace(model=trace.model, arch=trace.arch, layers=layers,
                       n_experts=trace.n_experts, k=trace.k, prompt_offsets=trace.prompt_offsets,
                       expert_ids=trace.expert_ids[:, :n], weights=trace.weights[:, :n],
                       phase=trace.phase, prompt_names=trace.prompt_names,
                       source=f"{trace.source}, first {n} layers")
    work_dir.mkdir(parents=True, exist_ok=True)
    partial = work_dir / f"{os.getpid()}.{fitted.name}"
    cut.save(partial)
    partial.rename(fitted)
    return str(fitted)


def measure_run(model: str, host_bytes: int, context: int, n_predict: int, threads: int,
                replay: str | None) -> dict:
    """In a worker: `moeswap run -p PROMPT -n n_predict --temp 0 --host-mem host_bytes
    --step-tokens STEP_TOKENS --cold-reads --prefetch off`, the file dropped from the page
    cache first -> decode tokens/s and the store's figures."""
    from moeswap.experts.build import load_options
    from moeswap.experts.settings import OffloadSettings
    from moeswap.generate import GenerationStats
    from moeswap.memory import HostCharge
    from moeswap.planner.probe import cost_model_rates
    from moeswap.runtime import load

    fd = os.open(model, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages would stay
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    settings = OffloadSettings(host_bytes=host_bytes, cold_reads=True, prefetch="off")
    runtime = load(model, threads=threads, replay_routing=replay,
                   **load_options(settings, HostCharge.for_sequence(context, STEP_TOKENS),
                                  cost_model_rates(settings, threads)))
    stats = GenerationStats()
    for _ in runtime.generate(PROMPT, n_predict, stats=stats, step_tokens=STEP_TOKENS,
                              temperature=0):
        pass
    s = runtime.stats()
    host, total = s["tiers"]["host"], s["total"]
    return {"decode_tok_s": stats.decode_tokens_per_second, "host_slots": host["slots"],
            "host_charged": host["held_bytes"] - host["slots"] * host["slot_bytes"],
            "hit_rate": total["hit_rate"], "requests": total["requests"],
            "disk_mib": total["disk_bytes"] / 2**20, "stall_s": total["stall_seconds"]}


def budgets(case: Case, shares: list[float], rates) -> list[tuple[float, int, object]]:
    """(share, --host-mem bytes, the plan with ``case.plan_trace``'s hit rate) per share: what
    the store charges (the floor) + the share's expert slots."""
    from moeswap.memory import HostCharge
    from moeswap.planner import plan_model
    from moeswap.planner.placement import Budget

    context = PROMPT_TOKENS + case.n_predict  # what `moeswap run` charges the store
    sizes = sizes_of(case.model)
    floor = sizes.host_charged(HostCharge.for_sequence(context, STEP_TOKENS))
    all_experts = sizes.n_expert * len(sizes.moe_layers)
    hosts = [(share, floor + int(share * all_experts) * sizes.slot_bytes) for share in shares]
    return [(share, host, plan_model(case.model, Budget(0, host, context, 1, STEP_TOKENS), rates,
                                     case.plan_trace).moeswap) for share, host in hosts]


def measured_rows(case: Case, shares: list[float], threads: int, rates, runs: Path,
                  timeout_s: float) -> list[dict]:
    rows = []
    for share, host, plan in budgets(case, shares, rates):
        load = (load_average() or [None])[0]
        results = []
        for repeat in range(case.repeats):
            r = run_call(f"{HERE}:measure_run", dict(
                model=case.model, host_bytes=host, context=plan.budget.context,
                n_predict=case.n_predict, threads=threads, replay=case.replay),
                runs, f"{Path(case.model).stem}-{share:g}-{repeat}", timeout_s)
            if r["status"] != "ok":
                raise MoeswapError(f"{Path(case.model).name}, {share:.0%}: {r['failure']}: "
                                   f"{r['error']}")
            results.append(r)
        fastest = max(results, key=lambda r: r["decode_tok_s"])
        error = plan.decode_tokens_per_second / fastest["decode_tok_s"] - 1
        rows.append({"model": Path(case.model).name, "share": share, "host_bytes": host,
                     "plan_host_charged": plan.host_charged, "plan_host_slots": plan.host_slots,
                     "predicted_hit_rate": plan.hits.total,
                     "predicted_tok_s": plan.decode_tokens_per_second,
                     "measured_tok_s": fastest["decode_tok_s"], "error": error,
                     "passed": abs(error) <= TOLERANCE, "load_before": load,
                     "runs": [r["decode_tok_s"] for r in results],
                     "store": {k: fastest[k] for k in ("host_slots", "host_charged", "hit_rate",
                                                       "requests", "disk_mib", "stall_s")}})
    return rows


def row_text(r: dict) -> str:
    s = r["store"]
    return (f"| {r['model']} | {r['share']:.0%} | {r['host_bytes'] / 2**20:.1f} | "
            f"{r['plan_host_slots']} / {s['host_slots']} | {r['predicted_hit_rate']:.1%} | "
            f"{r['predicted_tok_s']:.2f} | {r['measured_tok_s']:.2f} | {r['error']:+.1%} "
            f"{'PASS' if r['passed'] else 'FAIL'} | {' '.join(f'{v:.2f}' for v in r['runs'])} | "
            f"{r['load_before']} | {s['requests']} used, hit {s['hit_rate']:.1%}, disk "
            f"{s['disk_mib']:.1f} MiB, stalled {s['stall_s']:.2f} s |")


def own_routing(case: Case, shares: list[float], threads: int, rates,
                work_dir: Path) -> list[dict]:
    """Untimed, after the runs: the hit rate of the measured prompt's own routing replayed at
    each budget, beside the plan's (a reading of the trace's representativeness, not an input)."""
    own = Case(case.model, case.n_predict, case.repeats,
               trace_for(case.model, work_dir, case.n_predict, [PROMPT], "measured-prompt",
                         threads))
    return [{"model": Path(case.model).name, "share": share, "plan_hit_rate": plan.hits.total,
             "own_hit_rate": mine.hits.total, "own_tok_s": mine.decode_tokens_per_second}
            for (share, _, plan), (_, _, mine) in zip(budgets(case, shares, rates),
                                                      budgets(own, shares, rates))]


def cases_of(args, work_dir: Path) -> list[Case]:
    from moeswap.bench.generated import mixtral_of_size

    if bool(args.replay_routing) != bool(args.plan_routing):
        raise MoeswapError("--replay-routing and --plan-routing go together")
    model = args.model or args.default_model
    cases = [Case(model, args.n_predict, args.repeats,
                  trace_for(model, work_dir, args.n_predict, plan_prompts(), "plan-prompts",
                            args.threads))]
    generated = args.generated or (str(mixtral_of_size(work_dir, args.gb)) if args.gb else None)
    if generated and args.replay_routing:
        cases.append(Case(generated, args.gen_n_predict, args.gen_repeats,
                          fitted_trace(args.plan_routing, generated, work_dir),
                          args.replay_routing))
    elif generated:
        cases.append(Case(generated, args.gen_n_predict, args.gen_repeats,
                          trace_for(generated, work_dir, args.gen_n_predict, plan_prompts(),
                                    "plan-prompts", args.threads)))
    return cases


def measured(args, out_dir: Path) -> tuple[dict, str]:
    from dataclasses import asdict

    from moeswap.planner.probe import cached_overheads, cached_rates
    from moeswap.planner.rates import plan_rates

    work_dir, runs = Path(args.work_dir).expanduser(), out_dir / "runs"
    cases = cases_of(args, work_dir)
    notes = [f"- {Path(c.model).name}: plan routing {Path(c.plan_trace).name}; measured routing "
             f"{Path(c.replay).name + ' replayed' if c.replay else 'its own'}" for c in cases]
    if args.prepare:
        return {"cases": [asdict(c) for c in cases]}, "\n".join(notes)
    # this machine's probe entry for the runs' threads: measured when absent or refreshed
    cache = Path(args.probe_cache)
    cached_rates(args.threads, cache, refresh=args.refresh_probe)
    overheads = asdict(cached_overheads(args.threads, cache, refresh=args.refresh_probe))
    rates = plan_rates({}, cache, threads=str(args.threads))
    rows = [row for case in cases
            for row in measured_rows(case, args.shares, args.threads, rates, runs, args.timeout)]
    readings = [reading for case in cases if not case.replay
                for reading in own_routing(case, args.shares, args.threads, rates, work_dir)]
    lines = [f"Fixed costs: {overheads}", f"Rates: {rates.source}", "", *notes, "",
             "| model | expert share | --host-mem MiB | host slots plan / store | predicted hit "
             "rate | predicted tok/s | measured tok/s (fastest) | error | each run | load before "
             "| store stats |", "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|",
             *map(row_text, rows), "",
             *(f"- {g['model']} {g['share']:.0%}: plan's hit rate {g['plan_hit_rate']:.1%}, the "
               f"measured prompt's own routing replayed {g['own_hit_rate']:.1%} "
               f"({g['own_tok_s']:.2f} tok/s with it)" for g in readings)]
    body = {"cases": [asdict(c) for c in cases], "overheads": overheads,
            "rates": rates.source, "rows": rows, "own_routing": readings,
            "passed": all(row["passed"] for row in rows)}
    return body, "\n".join(lines)


def run(args, out_dir: Path) -> tuple[dict, str]:
    if args.mode == "cases":
        from moeswap.bench.suites.plan_cases import plan_cases

        return plan_cases(Path(args.work_dir).expanduser())
    return measured(args, out_dir)
