"""`moeswap bench`: the benchmark's scenarios, moeswap beside llama.cpp, and its suites
(`moeswap bench --suite NAME [options]`; docs/BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from moeswap.bench.scenarios import SCENARIOS
from moeswap.bench.suites import SUITES
from moeswap.cli.common_args import add_model_argument, add_threads_argument
from moeswap.cli.offload_args import (add_kv_type_argument, add_offload_arguments,
                                       offload_settings)
from moeswap.errors import MoeswapError

INPUTS = Path(__file__).resolve().parents[1] / "bench" / "inputs"  # shipped as package data


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark scenarios, each run in its own process; "
                                            "JSON, markdown and plots")
    add_model_argument(p, "a .gguf MoE file (default: the built-in model)", required=False)
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, from {', '.join(SCENARIOS)} (all)")
    p.add_argument("--compare", choices=["llama.cpp"],
                   help="also run llama.cpp (llama-cpp-python) on the same file and threads")
    p.add_argument("-o", "--output", metavar="DIR",
                   help="where report.json, report.md, the plots and each run's raw result go "
                        "(required)")
    add_threads_argument(p, os.cpu_count(), "threads for both engines (default: all cores)")
    p.add_argument("--size", choices=["full", "smoke"], default="full",
                   help="full: 8192-token long context, 32 new tokens; smoke: a few tokens of "
                        "each, for a quick check (full)")
    p.add_argument("--long-context", type=int, metavar="N",
                   help="positions of the long scenario, prompt + generated (size's default)")
    p.add_argument("--gen-tokens", type=int, metavar="N",
                   help="tokens generated per prompt (size's default)")
    p.add_argument("--prompt-tokens", type=int, metavar="N",
                   help="cut every prompt but the long one to its first N tokens (size's default)")
    p.add_argument("--windows", default="8,32,128", help="window-sweep's N (8,32,128)")
    p.add_argument("--resident", default="0,4,8,16",
                   help="resident-sweep's experts per MoE layer (0,4,8,16)")
    p.add_argument("--inputs", default=str(INPUTS), metavar="DIR",
                   help="the scenario texts (default: the ones shipped in moeswap/bench/inputs/)")
    p.add_argument("--timeout", type=float, default=900, metavar="S",
                   help="a run still going after S seconds is stopped and recorded (900)")
    add_offload_arguments(p)
    add_kv_type_argument(p)
    p.add_argument("--memory-limit", metavar="SIZE[,SIZE...]",
                   help="instead of the scenarios: each engine's worker in a memory cgroup of "
                        "each SIZE (made under this process's cgroup, removed after), moeswap's "
                        "budgets planned from it, llama.cpp mmap (and --mlock where the file "
                        "fits) with --compare; one prompt of --prompt-tokens (41) random ids, "
                        "--gen-tokens (32) greedy steps; tokens/s, hit rate, bytes read per "
                        "token, the cgroup's peak and failcnt, and the floor")
    p.add_argument("--suite", nargs=argparse.REMAINDER,
                   help="run a suite instead of the scenarios; everything after NAME is the "
                        "suite's (`moeswap bench --suite NAME --help`): "
                        + "; ".join(f"{name}: {text}" for name, text in SUITES.items()))
    p.epilog = ("--host-mem sets the budget of the long, batch8, conflict and window-sweep runs "
                "(default: a quarter of each layer's experts); resident-sweep sets its own.")
    p.set_defaults(handler=run_bench_command)


def int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise MoeswapError(f"{flag} takes comma-separated whole numbers, got {text!r}") from None


def command_line() -> str:
    return shlex.join(["moeswap", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else \
        "moeswap bench (called from Python)"


def run_suite_command(words: list[str], output: str | None) -> int:
    """`moeswap bench --suite NAME [options]`: the suite's own flags, then its report files."""
    import moeswap
    from moeswap.bench.report import write_suite_report
    from moeswap.bench.suites import suite_module

    if not words:
        raise MoeswapError(f"--suite needs a name: {', '.join(SUITES)}")
    suite = suite_module(words[0])
    parser = argparse.ArgumentParser(prog=f"moeswap bench --suite {words[0]}",
                                     description=SUITES[words[0]])
    parser.add_argument("-o", "--output", required=output is None, default=output, metavar="DIR",
                        help="where report.json, report.md and each run's raw result go")
    suite.add_arguments(parser)
    args = parser.parse_args(words[1:])
    args.default_model = str(moeswap.DEFAULT_MODEL)
    out = Path(args.output)
    body, text = suite.run(args, out)
    write_suite_report(out, words[0], command_line(), body, text)
    print(text)
    print(f"{out / 'report.md'}, {out / 'report.json'}", file=sys.stderr)
    return 0 if body.get("passed", True) else 1


def run_memory_limit_command(args) -> int:
    import torch

    import moeswap
    from moeswap.bench.memory_limits import run_limits
    from moeswap.bench.report import write_suite_report
    from moeswap.bench.scenarios import ModelFacts
    from moeswap.memory import parse_size

    model = str(args.model or moeswap.DEFAULT_MODEL)
    limits = [parse_size(size) for size in args.memory_limit.split(",") if size.strip()]
    n_vocab = ModelFacts.of(model).config.n_vocab
    prompt = torch.randint(3, n_vocab, (args.prompt_tokens or 41,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    out = Path(args.output)
    body, text = run_limits(model, limits, args.threads, prompt, args.gen_tokens or 32,
                            bool(args.compare), args.replay_routing, args.prefetch, out,
                            args.timeout, say=lambda line: print(line, file=sys.stderr),
                            kv_type=args.kv_type)
    write_suite_report(out, "memory-limit", command_line(), body, text)
    print(text)
    return 0 if all(row["status"] == "ok" for row in body["rows"]) else 1


def run_bench_command(args) -> int:
    from dataclasses import replace

    from rich.console import Console

    import moeswap
    from moeswap.bench.scenarios import ENGINES, SIZES, Plan
    from moeswap.bench.suite import run_bench
    from moeswap.memory import parse_size

    if args.suite is not None:
        return run_suite_command(args.suite, args.output)
    if args.output is None:
        raise MoeswapError("-o/--output DIR is required: where the report goes")
    if args.memory_limit:
        return run_memory_limit_command(args)
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        raise MoeswapError(f"unknown scenario {unknown[0] if unknown else '(none)'!r}; choose "
                           f"from {', '.join(SCENARIOS)}")
    sizes = SIZES[args.size]
    if args.long_context is not None:
        sizes = replace(sizes, long_context=args.long_context)
    if args.gen_tokens is not None:
        sizes = replace(sizes, gen_tokens=args.gen_tokens)
    if args.prompt_tokens is not None:
        sizes = replace(sizes, prompt_cap=args.prompt_tokens)
    if sizes.gen_tokens < 1 or sizes.long_context <= sizes.gen_tokens or \
            (sizes.prompt_cap is not None and sizes.prompt_cap < 1):
        raise MoeswapError("--gen-tokens and --prompt-tokens must be >= 1, --gen-tokens below "
                           "--long-context")
    model = args.model or moeswap.DEFAULT_MODEL
    if not Path(model).is_file():
        raise MoeswapError(f"{model}: no such file; give a .gguf MoE model")
    # the bench sets each run's host budget: the flags' other settings, typed once
    settings = offload_settings(args, (0, parse_size(args.device_mem or "0")), model_path=model,
                                say=lambda line: print(line, file=sys.stderr))
    plan = Plan(model=str(model), scenarios=scenarios, sizes=sizes, threads=args.threads,
                offload=settings, host_mem=args.host_mem, replay_routing=args.replay_routing,
                compare=ENGINES if args.compare else ("moeswap",),
                windows=int_list(args.windows, "--windows"),
                resident=int_list(args.resident, "--resident"), kv_type=args.kv_type)
    out = Path(args.output)
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    report = run_bench(plan, Path(args.inputs), out, args.timeout, command_line(), console)
    failed = sum(r["status"] != "ok" for r in report["runs"])
    console.print(f"{len(report['runs'])} runs, {failed} failed: {out / 'report.md'}, "
                  f"{out / 'report.json'}", markup=False)
    return 0
