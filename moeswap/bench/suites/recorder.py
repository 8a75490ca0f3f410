"""``--suite recorder``: decode time with the RoutingRecorder on versus off (issue 6: its cost
must stay under 3 %; was scripts/bench_recorder.py).

    moeswap bench -o DIR --suite recorder [--threads 2] [--n-layer 8] [--n-embd 256]
                  [--prompt-tokens 32] [--gen-tokens 64] [--repeats 15] [--work-dir DIR]

One worker (moeswap.bench.worker) loads the same generated Mixtral-shaped Q8_0 GGUF (written
once into --work-dir, moeswap.bench.generated) three times: without a recorder, with one
(expert ids and weights) and with one that also keeps the full router distribution. Each
repeat runs one prefill and then times single-token greedy decode steps on every variant, in a
rotating order, so drift in the machine's speed hits all variants alike. Reported: the median
decode ms/token per variant, the cost as the ratio of medians and as the median of the
per-repeat ratios, and that every variant produced the same tokens. Beside them, the
recorder's own work per token timed in isolation (its calls without the model around them), an
estimate that a busy machine's noise cannot swamp.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from moeswap.bench.worker import run_call
from moeswap.errors import MoeswapError

VARIANTS = ("off", "on", "on+probs")


def add_arguments(p) -> None:
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=8, help="layers of the generated model")
    p.add_argument("--n-embd", type=int, default=256, help="its width (a multiple of 64)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=64, help="timed decode steps per repeat")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--work-dir", default="~/.cache/moeswap/bench", help="generated models")


def model_file(args) -> Path:
    """The generated model: 8 experts, top-2, ff = 3.5 x width."""
    from moeswap.bench.generated import cached_model

    shape = dict(n_embd=args.n_embd, n_ff=args.n_embd * 7 // 2, n_head=8, n_head_kv=2,
                 n_expert=8, n_used=2, vocab=4096, n_layer=args.n_layer)
    name = "recorder-mixtral-q8_0-{n_layer}x{n_embd}x{n_ff}x{n_expert}.gguf".format(**shape)
    return cached_model(Path(args.work_dir).expanduser(), name, shape)


def decode_run(model, prompt: list[int], n_gen: int) -> tuple[float, list[int]]:
    """Prefill, then n_gen greedy single-token steps: (decode seconds per token, the tokens)."""
    cache = model.new_cache()
    logits = model.forward([torch.tensor(prompt)], [cache])[0][-1]
    tokens = [int(logits.argmax())]
    started = time.perf_counter()
    for _ in range(n_gen):
        logits = model.forward([torch.tensor(tokens[-1:])], [cache])[0][-1]
        tokens.append(int(logits.argmax()))
    return (time.perf_counter() - started) / n_gen, tokens


@torch.inference_mode()
def isolated_cost_us(model, recorder, steps: int = 2000) -> float:
    """The recorder's own work per decode token, timed without the model around it: one
    begin_forward and, per MoE layer, the block's hand-over (Router.report) of one token."""
    blocks = [layer.ffn for layer in model.layers]
    x = torch.randn(1, model.config.n_embd)  # [1, D]
    ids, weights = blocks[0].router(x)
    sequence = object()
    recorder.clear()
    started = time.perf_counter()
    for step in range(steps):
        recorder.begin_forward([(0, 1)], [step], [sequence])
        for block in blocks:
            block.router.report(recorder, block.layer, x, ids, weights)
    elapsed = time.perf_counter() - started
    recorder.clear()
    return elapsed / steps * 1e6


def measure(path: str, threads: int, n_layer: int, prompt_tokens: int, gen_tokens: int,
            repeats: int) -> dict:
    """In a worker: every variant's decode times, tokens and isolated cost."""
    from moeswap.routing.recorder import RoutingRecorder
    from moeswap.runtime import load

    recorders = {"off": None, "on": RoutingRecorder(),
                 "on+probs": RoutingRecorder(router_probs=True)}
    models = {v: load(path, threads=threads, recorder=r).model for v, r in recorders.items()}
    prompt = [1] + torch.randint(300, 4096, (prompt_tokens - 1,),
                                 generator=torch.Generator().manual_seed(1)).tolist()
    for variant in VARIANTS:  # warm-up: first-call allocations and kernel setup
        decode_run(models[variant], prompt, 2)
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[str, list[int]] = {}
    for repeat in range(repeats):
        order = VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]
        for variant in order:
            if recorders[variant] is not None:
                recorders[variant].clear()  # outside the timed steps; memory stays flat
            per_token, tokens[variant] = decode_run(models[variant], prompt, gen_tokens)
            seconds[variant].append(per_token)
    started = time.perf_counter()
    trace = recorders["on"].trace(model="bench", arch="llama", layers=list(range(n_layer)),
                                  n_experts=8, k=2)
    build_s = time.perf_counter() - started
    medians = {v: statistics.median(seconds[v]) for v in VARIANTS}
    rows = {}
    for variant in VARIANTS:
        ratios = [on / off for on, off in zip(seconds[variant], seconds["off"])]
        isolated = 0.0 if recorders[variant] is None else \
            isolated_cost_us(models[variant], recorders[variant])
        rows[variant] = dict(median_ms_per_token=medians[variant] * 1e3,
                             cost_ratio_of_medians=medians[variant] / medians["off"] - 1,
                             cost_median_of_ratios=statistics.median(ratios) - 1,
                             same_tokens_as_off=tokens[variant] == tokens["off"],
                             isolated_us_per_token=isolated,
                             ms_per_token_each_repeat=[s * 1e3 for s in seconds[variant]])
    return dict(variants=rows, trace_build_ms=build_s * 1e3, trace_tokens=trace.n_tokens)


def markdown(report: dict) -> str:
    lines = [f"{report['model']}; threads {report['threads']}; prompt {report['prompt_tokens']} "
             f"tokens, {report['gen_tokens']} decode steps x {report['repeats']} interleaved "
             "repeats.", "",
             "| recorder | median decode ms/token | cost (ratio of medians) | cost (median of "
             "ratios) | recorder alone, us/token (share of off's median) | same tokens |",
             "|---|---:|---:|---:|---:|---|"]
    off_us = report["variants"]["off"]["median_ms_per_token"] * 1e3
    for variant, row in report["variants"].items():
        alone = row["isolated_us_per_token"]
        lines.append(f"| {variant} | {row['median_ms_per_token']:.3f} "
                     f"| {100 * row['cost_ratio_of_medians']:+.2f} % "
                     f"| {100 * row['cost_median_of_ratios']:+.2f} % "
                     f"| {alone:.1f} ({100 * alone / off_us:.2f} %) "
                     f"| {row['same_tokens_as_off']} |")
    lines += ["", f"Building the trace of one run ({report['trace_tokens']} tokens) took "
                  f"{report['trace_build_ms']:.1f} ms (after decoding, not in the times above)."]
    return "\n".join(lines)


def run(args, out_dir: Path) -> tuple[dict, str]:
    if args.n_embd % 64:
        raise MoeswapError("--n-embd must be a multiple of 64 (Q8_0 blocks of the 3.5 x wider "
                           "experts)")
    path = model_file(args)
    found = run_call("moeswap.bench.suites.recorder:measure", dict(
        path=str(path), threads=args.threads, n_layer=args.n_layer,
        prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, repeats=args.repeats),
        out_dir / "runs", "recorder")
    if found.pop("status") != "ok":
        raise MoeswapError(f"the recorder's worker failed ({found['failure']}): {found['error']}")
    report = dict(model=(f"generated Mixtral-shaped Q8_0, {args.n_layer} layers, width "
                         f"{args.n_embd}, 8 experts top-2 ({path.stat().st_size / 1e6:.0f} MB)"),
                  threads=args.threads, prompt_tokens=args.prompt_tokens,
                  gen_tokens=args.gen_tokens, repeats=args.repeats, **found)
    return report, markdown(report)
