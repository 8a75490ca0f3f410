"""Decode time with the RoutingRecorder on versus off (issue 6: its cost must stay under 3 %).

One process loads the same generated Mixtral-shaped Q8_0 GGUF three times: without a
recorder, with one (expert ids and weights) and with one that also keeps the full router
distribution. Each repeat runs one prefill and then times single-token greedy decode steps on
every variant, in a rotating order, so drift in the machine's speed hits all variants alike.
Reported: the median decode ms/token per variant, the cost as the ratio of medians and as the
median of the per-repeat ratios, and that every variant produced the same tokens. Beside them,
the recorder's own work per token timed in isolation (its calls without the model around them),
an estimate that a busy machine's noise cannot swamp.

    python scripts/bench_recorder.py --json recorder.json --markdown recorder.md
    python scripts/bench_recorder.py --repeats 3 --gen-tokens 8   # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moeswap.bench.generated import write_mixtral  # noqa: E402  (the generated model)

import moeswap  # noqa: E402
from moeswap.routing.recorder import RoutingRecorder  # noqa: E402

VARIANTS = ("off", "on", "on+probs")


def model_file(args) -> Path:
    """The generated model (written once into --work-dir): 8 experts, top-2, ff = 3.5 x width."""
    shape = dict(n_embd=args.n_embd, n_ff=args.n_embd * 7 // 2, n_head=8, n_head_kv=2, n_expert=8,
                 n_used=2, vocab=4096, n_layer=args.n_layer)
    path = (Path(args.work_dir).expanduser() /
            "recorder-mixtral-q8_0-{n_layer}x{n_embd}x{n_ff}x{n_expert}.gguf".format(**shape))
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_mixtral(partial, shape)
        partial.replace(path)
    return path


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
def isolated_cost_us(model, recorder: RoutingRecorder, steps: int = 2000) -> float:
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


def measure(args, path: Path) -> dict:
    recorders = {"off": None, "on": RoutingRecorder(), "on+probs": RoutingRecorder(router_probs=True)}
    models = {v: moeswap.load(path, threads=args.threads, recorder=r).model for v, r in recorders.items()}
    prompt = [1] + torch.randint(300, 4096, (args.prompt_tokens - 1,),
                                 generator=torch.Generator().manual_seed(1)).tolist()
    for variant in VARIANTS:  # warm-up: first-call allocations and kernel setup
        decode_run(models[variant], prompt, 2)
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        order = VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]
        for variant in order:
            if recorders[variant] is not None:
                recorders[variant].clear()  # outside the timed steps; memory stays flat
            per_token, tokens[variant] = decode_run(models[variant], prompt, args.gen_tokens)
            seconds[variant].append(per_token)
        print(f"repeat {repeat + 1}/{args.repeats}: " +
              ", ".join(f"{v} {seconds[v][-1] * 1e3:.3f} ms/token" for v in VARIANTS), file=sys.stderr)
    started = time.perf_counter()
    trace = recorders["on"].trace(model="bench", arch="llama", layers=list(range(args.n_layer)),
                                  n_experts=8, k=2)
    build_s = time.perf_counter() - started
    medians = {v: statistics.median(seconds[v]) for v in VARIANTS}
    rows = {}
    for variant in VARIANTS:
        ratios = [on / off for on, off in zip(seconds[variant], seconds["off"])]
        rows[variant] = dict(median_ms_per_token=medians[variant] * 1e3,
                             cost_ratio_of_medians=medians[variant] / medians["off"] - 1,
                             cost_median_of_ratios=statistics.median(ratios) - 1,
                             same_tokens_as_off=tokens[variant] == tokens["off"],
                             isolated_us_per_token=(isolated_cost_us(models[variant], recorders[variant])
                                                    if recorders[variant] is not None else 0.0),
                             ms_per_token_each_repeat=[s * 1e3 for s in seconds[variant]])
    return dict(variants=rows, trace_build_ms=build_s * 1e3, trace_tokens=trace.n_tokens)


def markdown(report: dict) -> str:
    lines = [f"{report['model']}; threads {report['threads']}; prompt {report['prompt_tokens']} tokens, "
             f"{report['gen_tokens']} decode steps x {report['repeats']} interleaved repeats; "
             f"{report['machine']}.", "",
             "| recorder | median decode ms/token | cost (ratio of medians) | cost (median of ratios) "
             "| recorder alone, us/token (share of off's median) | same tokens |",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=8, help="layers of the generated model")
    parser.add_argument("--n-embd", type=int, default=256, help="its width (a multiple of 64)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=64, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--work-dir", default="~/.cache/moeswap/bench")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--markdown", help="write the markdown table here")
    args = parser.parse_args()
    if args.n_embd % 64:
        parser.error("--n-embd must be a multiple of 64 (Q8_0 blocks of the 3.5 x wider experts)")
    path = model_file(args)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    report = dict(model=(f"generated Mixtral-shaped Q8_0, {args.n_layer} layers, width {args.n_embd}, "
                         f"8 experts top-2 ({path.stat().st_size / 1e6:.0f} MB)"),
                  threads=args.threads, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                  repeats=args.repeats, machine=f"{cpu}, {platform.system()}", **measure(args, path))
    table = markdown(report)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
