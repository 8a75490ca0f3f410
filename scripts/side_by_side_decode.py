"""Decode speed of moeswap and llama.cpp in one process, alternating, for machines whose speed
drifts between the bench's separate runs (docs/BENCHMARKS.md, "one graph per step").

    python scripts/side_by_side_decode.py MODEL.gguf [--mmap] [--rounds 8] [--steps 16]

Each round times ``--steps`` decode steps of llama.cpp (``Llama.eval``, one token, f16 KV as
its default) then as many of moeswap (``CausalLM.forward``, last row only, f16 KV, repacked
layouts and the weights in RAM as ``moeswap run``; ``--mmap``: from the mapped file, as
llama.cpp), both after a 20-token prompt, 2 threads; prints ms per token per round and the
ratio of the medians. Both engines run ggml's same library.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    import llama_cpp

    from moeswap.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--mmap", action="store_true", help="moeswap computes from the mapped file")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    llm = llama_cpp.Llama(args.model, n_ctx=512, n_threads=2, n_batch=512, verbose=False)
    model = load_model(args.model, threads=2, kv_type="f16", repack=True, in_ram=not args.mmap)
    prompt = list(range(1, 21))
    cache = model.new_cache()
    model.forward([torch.tensor(prompt)], [cache], last_only=True)
    llm.eval(prompt)
    times: dict[str, list[float]] = {"llama.cpp": [], "moeswap": []}
    token = torch.tensor([5])
    for _ in range(args.rounds):
        began = time.perf_counter()
        for _ in range(args.steps):
            llm.eval([5])
        times["llama.cpp"].append((time.perf_counter() - began) / args.steps * 1e3)
        began = time.perf_counter()
        for _ in range(args.steps):
            model.forward([token], [cache], last_only=True)
        times["moeswap"].append((time.perf_counter() - began) / args.steps * 1e3)
    for engine, ms in times.items():
        print(f"{engine:9} ms/token " + " ".join(f"{t:.1f}" for t in ms)
              + f"  median {statistics.median(ms):.2f}")
    ratio = statistics.median(times["llama.cpp"]) / statistics.median(times["moeswap"])
    print(f"moeswap decode speed / llama.cpp's: {ratio:.2f}x")


if __name__ == "__main__":
    main()
