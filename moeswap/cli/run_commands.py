"""`moeswap run`: load a model, stream a completion, report speed and memory."""

from __future__ import annotations

import sys

from rich.console import Console

from moeswap.cli.common_args import (add_force_argument, add_model_argument,
                                     add_threads_argument, warn_beyond_training)
from moeswap.cli.load_report import load_progress
from moeswap.cli.offload_args import (add_exact_tiers_argument, add_mmap_argument,
                                      add_kv_type_argument,
                                      add_offload_arguments,
                                      add_step_tokens_argument,
                                      offload_load_options, offload_settings, stats_lines)
from moeswap.cli.sampling_args import add_sampling_arguments, sampling_params
from moeswap.errors import MoeswapError


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="generate text from a prompt, streamed")
    add_model_argument(p, "a .gguf file or a Hugging Face folder (default: the built-in model, "
                          "docs/MODEL.md)", required=False)
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (128)")
    p.add_argument("-c", "--ctx", type=int, default=None,
                   help="positions of the context: prompt and reply (default: the prompt's "
                        "bytes + 1 + -n, enough for any tokenization); the reply stops there")
    add_sampling_arguments(p)
    add_threads_argument(p)
    p.add_argument("--trace", metavar="OUT.npz",
                   help="record every routing decision and write the trace here (moeswap stats)")
    p.add_argument("--verbose", action="store_true",
                   help="log each tensor as it is mapped: name, shape, type, where it lives")
    add_step_tokens_argument(p)
    add_kv_type_argument(p)
    add_exact_tiers_argument(p)
    add_mmap_argument(p)
    add_offload_arguments(p)
    add_force_argument(p)
    p.add_argument("--plan", choices=["auto"],
                   help="budgets from the planner for this machine's free RAM and GPU, printed "
                        "first; --host-mem / --device-mem given win (docs/PLANNER.md)")
    p.set_defaults(handler=run_generate)


def run_generate(args) -> int:
    import moeswap
    from dataclasses import asdict

    from moeswap.generate import GenerationStats, check_step_tokens
    from moeswap.memory import HostCharge
    from moeswap.runtime import peak_rss_bytes

    # Checked before loading, which can take minutes.
    check_step_tokens(args.step_tokens)
    sampling = sampling_params(args)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    model_path = args.model or moeswap.DEFAULT_MODEL
    recorder = None
    if args.trace:
        from moeswap.routing.recorder import RoutingRecorder

        recorder = RoutingRecorder()
    with load_progress(model_path, err, args.verbose) as (progress, on_tensor):
        prompt = len(args.prompt.encode()) + 1  # at most a token per byte, and BOS
        context = args.ctx or prompt + args.n_predict
        # the most tokens one forward feeds: a prompt chunk (decode steps feed one)
        step = min(args.step_tokens, prompt, context)
        budgets = (auto_budgets(args, model_path, context, progress.console, step)
                   if args.plan == "auto" else None)
        settings = offload_settings(args, budgets, model_path=model_path,
                                    say=lambda line: progress.console.print(line, markup=False))
        # force: cli.main validated the file (or was told --force) before the plan read it
        runtime = moeswap.load(model_path, threads=args.threads, verbose_log=on_tensor,
                               force=True, repack=not args.exact_tiers,
                               recorder=recorder, replay_routing=args.replay_routing,
                               **offload_load_options(settings, HostCharge.for_sequence(
                                   context, step, args.kv_type), args.threads, model_path,
                                   args.mmap))
        if recorder is not None and not runtime.config.moe_layers:
            raise MoeswapError(f"{model_path}: this {runtime.config.arch} model has no routed "
                               "experts; there is no routing to trace (drop --trace)")
        if args.ctx:
            warn_beyond_training(runtime, args.ctx)

    stats = GenerationStats()
    prompt_ids = runtime.encode(args.prompt)
    if len(prompt_ids) >= context:
        raise MoeswapError(f"the prompt is {len(prompt_ids)} tokens, the context (--ctx) "
                           f"{context} positions: give a larger --ctx or a shorter prompt")
    n_predict = min(args.n_predict, context - len(prompt_ids))
    tokens = runtime.generate(prompt_ids, n_predict, stats=stats,
                              step_tokens=args.step_tokens, **asdict(sampling))
    text = runtime.tokenizer.stream(prompt_ids)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    for token in tokens:
        sys.stdout.write(text.push(token))
        sys.stdout.flush()
    sys.stdout.write("\n")
    err.print(f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tokens_per_second:.2f} tokens/s"
              f" | decode: {stats.generated_tokens} tokens, "
              f"{stats.decode_tokens_per_second:.2f} tokens/s"
              f" | peak RSS: {peak_rss_bytes() / 2**20:.0f} MiB", markup=False)
    for line in stats_lines(runtime.stats()):
        err.print(line, markup=False)
    if recorder is not None:
        save_trace(recorder, runtime, model_path, args.trace)
        err.print(f"routing trace: {args.trace} (see it with: moeswap stats {args.trace} --plots DIR)",
                  markup=False)
    return 0


def auto_budgets(args, model_path, context: int, console, step_tokens: int,
                 sequences: int = 1) -> tuple[int | None, int]:
    """The plan's (host, device) budgets for this machine (the flags given stay; host None:
    all resident), its lines printed; ``step_tokens``: the most tokens one forward feeds;
    ``sequences``: contexts cached at once (serve's --max-batch)."""
    from moeswap.memory import parse_size
    from moeswap.planner.auto import auto_plan, machine_memory
    from moeswap.planner.rates import plan_rates

    profile = args.policy.removeprefix("pinned:") if args.policy.startswith("pinned:") else None
    auto = auto_plan(model_path, context, machine_memory(), plan_rates({}),
                     parse_size(args.host_mem) if args.host_mem else None,
                     parse_size(args.device_mem) if args.device_mem else None, profile,
                     step_tokens, args.kv_type, sequences)
    for line in auto.describe():
        console.print(line, markup=False)
    return auto.host_bytes, auto.device_bytes


def save_trace(recorder, runtime, model_path, out_path) -> None:
    """Written beside ``out_path`` and renamed over it: a failed write (a full disk, SIGTERM)
    leaves an existing trace as it was (formats.atomic_file)."""
    from moeswap.formats.atomic_file import atomic_output
    from moeswap.routing.traces import model_name

    config = runtime.config
    trace = recorder.trace(model=model_name(model_path, runtime.model.source), arch=config.arch,
                           layers=config.moe_layers, n_experts=config.n_expert,
                           k=config.n_expert_used, source=f"moeswap run of {model_path}")
    with atomic_output(out_path, "the trace") as tmp:
        trace.save(tmp)
