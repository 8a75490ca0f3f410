"""`moeswap trace`, `stats`, `simulate`, `profile`, `import-trace`: parse arguments, call moeswap.routing."""

from __future__ import annotations

import json

from rich.console import Console
from rich.progress import Progress, track

from moeswap.cli.common_args import add_model_argument, add_threads_argument
from moeswap.cli.console import stdout_console
from moeswap.errors import MoeswapError
# trace_capture (the engine, torch) and plots (matplotlib) load inside the commands that use them,
# so that `moeswap --help` and the trace tools start fast.
from moeswap.routing import importers, policy_specs, profile, simulate, stats
from moeswap.routing.traces import RoutingTrace


def register(subparsers) -> None:
    p = subparsers.add_parser("trace", help="run a model on prompts (greedy) and record its routing")
    add_model_argument(p, "a .gguf file or a Hugging Face folder")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("-p", "--prompt", action="append", help="a prompt (repeat for several)")
    given.add_argument("--prompts", metavar="FILE",
                       help="one prompt per line, or .jsonl objects {\"prompt\": ..., \"name\": ...}")
    p.add_argument("-o", "--output", required=True, help="moeswap trace (.npz) to write")
    p.add_argument("-n", "--n-predict", type=int, default=32,
                   help="tokens to generate and record per prompt after it (default 32; 0: prompt only)")
    p.add_argument("--router-probs", action="store_true",
                   help="also keep every token's full router distribution (E values per layer)")
    add_threads_argument(p)
    p.set_defaults(handler=run_trace)

    p = subparsers.add_parser("stats", help="routing statistics of a trace: popularity, reuse, predictability")
    p.add_argument("trace", help="a moeswap trace (.npz)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plots", metavar="DIR", help="also write popularity, reuse-distance and hit-rate PNGs here")
    p.set_defaults(handler=run_stats)

    p = subparsers.add_parser("simulate", help="replay a trace through cache policies; hit rate per capacity")
    p.add_argument("trace", help="a moeswap trace (.npz)")
    p.add_argument("--policy", default="lru,lfu,belady", help=f"comma-separated: {policy_specs.POLICY_HELP}")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--capacity", help="comma-separated experts per layer, e.g. 2,4,8 (1,2,4)")
    size.add_argument("--slots", help="comma-separated slots in total, the unit budgets come in: "
                                      "one --global cache of N, or N shared out evenly by layer")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--per-layer", dest="scope", action="store_const", const="per-layer",
                       help="one cache per layer (default)")
    scope.add_argument("--global", dest="scope", action="store_const", const="global",
                       help="one cache of capacity x layers shared by all layers")
    p.add_argument("--order", choices=simulate.ORDERS, default="step",
                   help="requests as the engine makes them: each forward pass layer by layer, "
                        "one per distinct expert a layer's tokens picked (step, the default); "
                        "the same, one per pick (layer); or token by token, one per pick "
                        "(token). On decode-only traces they differ only in the order of a "
                        "token's picks")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=run_simulate, scope="per-layer")

    p = subparsers.add_parser("profile", help="the hot experts of a trace (for --policy pinned:FILE) and its reuse table")
    p.add_argument("trace", help="a moeswap trace (.npz)")
    p.add_argument("--budget", type=int, required=True, help="experts to pin, in total over all layers")
    p.add_argument("--per-layer", action="store_true", help="--budget counts experts per layer instead")
    p.add_argument("--window", type=int, metavar="N",
                   help="the reuse table's window in tokens (default: chosen by cross-validation "
                        "over a few capacities)")
    p.add_argument("-o", "--output", required=True, help="profile .json to write")
    p.set_defaults(handler=run_profile)

    p = subparsers.add_parser("import-trace", help="convert a JSONL, Switch router-trace JSON or CSV trace")
    p.add_argument("source", help=".jsonl (one row per problem, layer, token), router-trace .json, or "
                                  ".csv (phase,n_tokens,layer,token_idx,e0..)")
    p.add_argument("-o", "--output", required=True, help="moeswap trace (.npz) to write")
    p.add_argument("--model", help="model name to record (default: what the source implies)")
    p.add_argument("--arch", help="architecture to record, e.g. llama, qwen3moe")
    p.add_argument("--experts", type=int, help="routed experts per layer (default: largest id seen + 1)")
    p.set_defaults(handler=run_import)


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise MoeswapError(f"{option} {text!r}: give comma-separated whole numbers, e.g. 2,4,8") from None
    if not values or min(values) < 0:
        raise MoeswapError(f"{option} {text!r}: give at least one number, none negative")
    return values


def run_trace(args) -> int:
    from moeswap import trace_capture as capture

    if args.prompts:
        prompts = capture.read_prompts(args.prompts)
    else:
        prompts = [capture.Prompt(f"prompt-{i}", text) for i, text in enumerate(args.prompt)]
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("tracing", total=len(prompts))
        trace = capture.record_trace(args.model, prompts, new_tokens=args.n_predict,
                                     router_probs=args.router_probs, threads=args.threads,
                                     on_prompts_done=lambda done: progress.update(task, completed=done))
    trace.save(args.output)
    print(f"wrote {args.output}: {trace.n_tokens} tokens, {trace.n_prompts} prompts, "
          f"{trace.n_layers} layers, {trace.n_experts} experts, top-{trace.k}")
    return 0


def run_stats(args) -> int:
    from moeswap.routing import plots

    trace = RoutingTrace.load(args.trace)
    result = stats.trace_stats(trace)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        stats.render_stats(result, stdout_console())
    if args.plots:
        specs = ["lru", "lfu", "lfuda", "belady"]
        capacities = list(range(1, trace.n_experts + 1))
        curves = list(track(policy_specs.simulate_grid(trace, specs, capacities, "per-layer"),
                            total=len(specs) * len(capacities), description="simulating",
                            console=Console(stderr=True), transient=True))
        for path in plots.write_plots(result, curves, args.plots):
            Console(stderr=True).print(f"wrote {path}")
    return 0


def run_simulate(args) -> int:
    trace = RoutingTrace.load(args.trace)
    specs = [s.strip() for s in args.policy.split(",") if s.strip()]
    slots = args.slots is not None
    capacities = (_int_list(args.slots, "--slots") if slots
                  else _int_list(args.capacity or "1,2,4", "--capacity"))
    for warning in simulate.capacity_warnings(trace, capacities, args.scope, slots):
        Console(stderr=True).print(f"moeswap: warning: {warning}", markup=False)
    results = list(track(policy_specs.simulate_grid(trace, specs, capacities, args.scope, slots,
                                                    args.order),
                         total=len(specs) * len(capacities), description="simulating",
                         console=Console(stderr=True), transient=True))
    if args.json:
        print(json.dumps(simulate.results_json(results), indent=1))
    else:
        simulate.render_results(results, stdout_console())
    return 0


def run_profile(args) -> int:
    trace = RoutingTrace.load(args.trace)
    if args.window is not None and args.window < 1:
        raise MoeswapError(f"--window must be at least 1 token, got {args.window}")
    with Console(stderr=True).status("learning the reuse table") as status:
        def on_window(window: int) -> None:
            status.update(f"learning the reuse table: scoring a window of {window} tokens "
                          f"(of {', '.join(map(str, profile.WINDOW_CHOICES))})")

        result = profile.build_profile(trace, args.budget, args.per_layer,
                                       source=f"profiled from {args.trace}", window=args.window,
                                       on_window=on_window)
    result.save(args.output)
    print(f"wrote {args.output}: {result.budget} hot experts over {len(result.layers)} layers")
    return 0


def run_import(args) -> int:
    trace = importers.import_trace(args.source, model=args.model, arch=args.arch, n_experts=args.experts)
    trace.save(args.output)
    print(f"wrote {args.output}: {trace.n_tokens} tokens, {trace.n_prompts} prompts, "
          f"{trace.n_layers} layers, {trace.n_experts} experts, top-{trace.k}")
    return 0
