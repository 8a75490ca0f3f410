"""Prompt and decode speed of moeswap and llama.cpp in one process, alternating, for machines
whose speed drifts between the bench's separate runs (docs/BENCHMARKS.md, "one graph per step").

    python scripts/side_by_side.py MODEL.gguf [--mmap] [--rounds 8] [--steps 16] [--prompt 64]
                                   [--batch 8]

Each round times, for llama.cpp then moeswap: one ``--prompt``-token prompt (the bench's random
ids) from an empty cache whose buffers are kept (llama.cpp's ``reset``, moeswap's
``KVCache.truncate(0)``), then ``--steps`` decode steps after a 20-token prompt (llama.cpp's
``Llama.eval``, one token; moeswap's ``CausalLM.forward``, last row only). f16 KV (llama.cpp's
default), 2 threads, moeswap with repacked layouts and the weights in RAM as ``moeswap run``
(``--mmap``: from the mapped file, as llama.cpp). ``--batch N``: moeswap's decode steps take N
sequences at once (the bench's batch8 scenario), llama.cpp's one token, as one sequence after
another; the figure is then per token of the batch. Prints each round's figures and the ratios
of the medians. Both engines run ggml's same library.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    import llama_cpp

    from moeswap.bench.suites.decode import prompt_ids
    from moeswap.generate import prefill
    from moeswap.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--mmap", action="store_true", help="moeswap computes from the mapped file")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (at most 512)")
    p.add_argument("--batch", type=int, default=1, help="sequences in one moeswap decode step")
    args = p.parse_args()
    if not 1 <= args.batch <= args.prompt - 20:
        p.error(f"--batch takes 1 to {args.prompt - 20} (--prompt less 20) sequences")
    llm = llama_cpp.Llama(args.model, n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=512,
                          n_ubatch=512, verbose=False)
    model = load_model(args.model, threads=2, kv_type="f16", repack=True, in_ram=not args.mmap)
    prompt = prompt_ids(llm.token_bos(), llm.n_vocab(), args.prompt)
    cache = model.new_cache()
    caches = [cache] + [model.new_cache() for _ in range(args.batch - 1)]
    prompt_s: dict[str, list[float]] = {"llama.cpp": [], "moeswap": []}
    step_ms: dict[str, list[float]] = {"llama.cpp": [], "moeswap": []}
    for _ in range(args.rounds):
        llm.reset()
        began = time.perf_counter()
        llm.eval(prompt)
        prompt_s["llama.cpp"].append(time.perf_counter() - began)
        cache.truncate(0)
        began = time.perf_counter()
        prefill(model, [prompt], [cache], len(prompt))
        prompt_s["moeswap"].append(time.perf_counter() - began)
        llm.reset()
        llm.eval(prompt[:20])
        for i, each in enumerate(caches):  # distinct sequences (their own routing)
            each.truncate(0)
            prefill(model, [prompt[i:i + 20]], [each], 20)
        began = time.perf_counter()
        for _ in range(args.steps):
            llm.eval([5])
        step_ms["llama.cpp"].append((time.perf_counter() - began) / args.steps * 1e3)
        tokens = [torch.tensor([5 + i]) for i in range(args.batch)]
        began = time.perf_counter()
        for _ in range(args.steps):
            model.forward(tokens, caches, last_only=True)
        step_ms["moeswap"].append((time.perf_counter() - began) / (args.steps * args.batch) * 1e3)
    for engine in prompt_s:
        rates = [args.prompt / s for s in prompt_s[engine]]
        print(f"{engine:9} prompt tokens/s " + " ".join(f"{r:.0f}" for r in rates)
              + f"  median {statistics.median(rates):.1f}")
        print(f"{engine:9} decode ms/token " + " ".join(f"{t:.1f}" for t in step_ms[engine])
              + f"  median {statistics.median(step_ms[engine]):.2f}")
    prompt_ratio = statistics.median(prompt_s["llama.cpp"]) / statistics.median(prompt_s["moeswap"])
    decode_ratio = statistics.median(step_ms["llama.cpp"]) / statistics.median(step_ms["moeswap"])
    print(f"moeswap speed / llama.cpp's: prompt {prompt_ratio:.2f}x, decode {decode_ratio:.2f}x")


if __name__ == "__main__":
    main()
