"""Server load test on loopback: N requests, C at a time, batched versus one at a time.

Each mode loads the model afresh (a cold expert store), serves it with uvicorn on 127.0.0.1,
sends the same greedy /v1/completions requests with httpx, and reports: errors, generated
tokens, wall time, tokens/s, latency percentiles, peak RSS, and the expert store's bytes read
from disk and hit rate when --host-mem turns the store on.

    python scripts/bench_server.py MODEL --requests 64 --concurrency 16 --max-tokens 32
    python scripts/bench_server.py MODEL --requests 8 --concurrency 4 --max-tokens 8   # small

"one at a time" is the same server with --max-batch 1 and the same client concurrency, so the
only difference is batching.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from moeswap.cli.offload_args import add_offload_arguments, store_factory
from moeswap.runtime import load, peak_rss_bytes
from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions

WORDS = ("the river", "a small engine", "seven lanterns", "the old map", "winter light",
         "a quiet harbour", "the second door", "copper wire")


def prompts(n: int) -> list[str]:
    return [f"Tell me about {WORDS[i % len(WORDS)]}, part {i}." for i in range(n)]


async def fire(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    slots = asyncio.Semaphore(concurrency)
    latencies, tokens, errors = [], 0, []

    async def one(client: httpx.AsyncClient, text: str) -> None:
        nonlocal tokens
        async with slots:
            started = time.perf_counter()
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0})
            latencies.append(time.perf_counter() - started)
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text[:200]}")
            else:
                tokens += r.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as client:
        await asyncio.gather(*(one(client, t) for t in texts))
    return {"wall": time.perf_counter() - started, "tokens": tokens, "errors": errors,
            "latencies": sorted(latencies)}


def run_mode(args, max_batch: int) -> dict:
    runtime = load(args.model, threads=args.threads,
                   expert_runner=store_factory(args, args.ctx * max_batch))
    name = Path(args.model).stem
    app = create_app(runtime, ServerOptions(name, BatchOptions(
        max_batch=max_batch, queue_size=args.requests, ctx=args.ctx)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = asyncio.run(fire(url, name, prompts(args.requests), args.concurrency,
                                  args.max_tokens))
    finally:
        server.should_exit = True
        thread.join()
    store = runtime.stats()
    result["disk_bytes"] = store["total"]["disk_bytes"] if store else None
    result["hit_rate"] = store["total"]["hit_rate"] if store else None
    result["rss"] = peak_rss_bytes()
    return result


def row(label: str, r: dict) -> str:
    lat = r["latencies"]
    p50, p95 = statistics.median(lat), lat[min(len(lat) - 1, int(0.95 * len(lat)))]
    store = "" if r["disk_bytes"] is None else \
        f" {r['disk_bytes'] / 2**20:.1f} | {r['hit_rate']:.1%} |"
    return (f"| {label} | {len(r['errors'])} | {r['tokens']} | {r['wall']:.2f} | "
            f"{r['tokens'] / r['wall']:.2f} | {p50:.2f} | {p95:.2f} | "
            f"{r['rss'] / 2**20:.0f} |{store}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    add_offload_arguments(p)
    args = p.parse_args()
    batched = run_mode(args, args.max_batch)
    single = run_mode(args, 1)  # peak RSS is the process's: this row's includes the first's
    store = " MiB read from disk | hit rate |" if batched["disk_bytes"] is not None else ""
    print(f"{args.requests} requests, {args.concurrency} concurrent, {args.max_tokens} tokens "
          f"each, greedy, ctx {args.ctx}")
    print(f"| mode | errors | tokens | wall s | tokens/s | p50 s | p95 s | peak RSS MiB |{store}")
    print("|---" * (8 + (2 if store else 0)) + "|")
    print(row(f"batched (--max-batch {args.max_batch})", batched))
    print(row("one at a time (--max-batch 1)", single))
    for error in batched["errors"] + single["errors"]:
        print("error:", error, file=sys.stderr)
    return 1 if batched["errors"] or single["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
