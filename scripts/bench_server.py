"""Server load test on loopback: N requests, C at a time, batched versus one at a time.

Each mode starts its own `moeswap serve` process on 127.0.0.1 (a fresh load, a cold expert
store), sends the same greedy /v1/completions requests with httpx, and reports: errors,
generated tokens, wall time, tokens/s, latency percentiles, the server's RSS (from
/proc/PID/status: VmRSS once it is ready, the runtime's baseline; VmHWM, its peak, at the end;
and the peak growth of RssAnon, allocated memory, and RssFile, mapped file pages the kernel can
drop, polled every 20 ms) and, when --host-mem turns the expert store on, the MiB read from
disk and the hit rate (from /metrics). Flags this script does not know go to
`moeswap serve` (--host-mem, --threads, --policy ...).

    python scripts/bench_server.py MODEL --requests 64 --concurrency 16 --max-tokens 32 \
        --host-mem 26MiB --threads 1
    python scripts/bench_server.py MODEL --requests 8 --concurrency 4 --max-tokens 8   # small

"one at a time" is `moeswap serve --max-batch 1` with the same client concurrency and --ctx,
so the only difference is batching; its --host-mem is smaller by what the batch charges there
beyond one request (15 more contexts of KV cache, and the step's working memory:
moeswap.server.budget), so that the room left for experts is the same in both modes. The exit
status is 1 if any request failed or a server's RssAnon grew by more than its --host-mem plus
--device-mem.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from moeswap.cli.offload_args import add_offload_arguments
from moeswap.memory import parse_size
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.server.batching import BatchOptions
from moeswap.server.budget import batch_charge

FIELDS = ("VmRSS", "RssAnon", "RssFile")
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
            try:
                r = await client.post(url + "/v1/completions", json={
                    "model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0})
            except httpx.HTTPError as e:  # a dropped connection is an error, not a crash
                errors.append(f"{type(e).__name__}: {e}")
                return
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


def proc_status_bytes(pid: int, field: str) -> int:
    """A 'VmRSS:   1234 kB' line of /proc/PID/status, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(args, serve_flags: list[str], max_batch: int, ctx: int, host_mem: int | None) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moeswap", "serve", args.model, "--port", str(port),
         "--max-batch", str(max_batch), "--queue", str(args.requests), "--ctx", str(ctx),
         *serve_flags, *([] if host_mem is None else ["--host-mem", str(host_mem)])],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                raise SystemExit(f"moeswap serve exited {server.returncode}: "
                                 f"{server.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("moeswap serve did not answer /health within 120 s")
            time.sleep(0.1)
        baseline = {f: proc_status_bytes(server.pid, f) for f in FIELDS}
        peaks = dict(baseline)
        sampling = threading.Event()

        def sample() -> None:  # /proc has no peak per kind of memory: poll it
            while not sampling.wait(0.02):
                for f in FIELDS:
                    peaks[f] = max(peaks[f], proc_status_bytes(server.pid, f))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        result = asyncio.run(fire(url, model, prompts(args.requests), args.concurrency,
                                  args.max_tokens))
        sampling.set()
        sampler.join()
        metrics = httpx.get(url + "/metrics").text
        result["baseline"] = baseline["VmRSS"]
        result["anon_growth"] = peaks["RssAnon"] - baseline["RssAnon"]
        result["file_growth"] = peaks["RssFile"] - baseline["RssFile"]
        result["peak"] = proc_status_bytes(server.pid, "VmHWM")
    finally:
        server.terminate()
        server.wait(30)
    result["disk_bytes"] = metric(metrics, 'moeswap_expert_bytes_moved_total{from="disk"}')
    result["hit_rate"] = metric(metrics, "moeswap_expert_hit_rate")
    return result


def without_host_mem(flags: list[str]) -> list[str]:
    """The flags without --host-mem (each mode gets its own)."""
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--host-mem":
            skip = True
        elif not flag.startswith("--host-mem="):
            kept.append(flag)
    return kept


def row(label: str, r: dict) -> str:
    lat = r["latencies"]
    p50, p95 = statistics.median(lat), lat[min(len(lat) - 1, int(0.95 * len(lat)))]
    store = "" if r["disk_bytes"] is None else \
        f" {r['disk_bytes'] / 2**20:.1f} | {r['hit_rate']:.1%} |"
    return (f"| {label} | {len(r['errors'])} | {r['tokens']} | {r['wall']:.2f} | "
            f"{r['tokens'] / r['wall']:.2f} | {p50:.2f} | {p95:.2f} | "
            f"{r['baseline'] / 2**20:.0f} | {r['peak'] / 2**20:.0f} | "
            f"{r['anon_growth'] / 2**20:.1f} | {r['file_growth'] / 2**20:.1f} |{store}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=512)
    args, serve_flags = p.parse_known_args()
    offload = argparse.ArgumentParser(add_help=False)
    offload.add_argument("--threads")
    offload.add_argument("--step-tokens", type=int, default=512)
    add_offload_arguments(offload)
    budget = offload.parse_known_args(serve_flags)[0]
    device = parse_size(budget.device_mem) if budget.device_mem else 0
    host = {args.max_batch: None, 1: None}
    if budget.host_mem:  # the same room for experts with one request a step
        host[args.max_batch] = parse_size(budget.host_mem)
        config = config_from_gguf(GGUFFile.open(args.model))
        # shared weights and staging are the same in both modes: only the batch's terms differ
        charged = {b: batch_charge(BatchOptions(max_batch=b, ctx=args.ctx,
                                                step_tokens=budget.step_tokens)).bytes(config, 0, 0)
                   for b in host}
        host[1] = host[args.max_batch] - (charged[args.max_batch] - charged[1])
    serve_flags = without_host_mem(serve_flags)
    batched = run_mode(args, serve_flags, args.max_batch, args.ctx, host[args.max_batch])
    single = run_mode(args, serve_flags, 1, args.ctx, host[1])
    store = " MiB read from disk | hit rate |" if batched["disk_bytes"] is not None else ""
    print(f"{args.requests} requests, {args.concurrency} concurrent, {args.max_tokens} tokens "
          f"each, greedy, ctx {args.ctx}; moeswap serve {' '.join(serve_flags)}; --host-mem "
          + " / ".join("-" if h is None else f"{h / 2**20:.1f}MiB" for h in host.values()))
    print("| mode | errors | tokens | wall s | tokens/s | p50 s | p95 s | baseline RSS MiB "
          f"| peak RSS MiB | RssAnon growth MiB | RssFile growth MiB |{store}")
    print("|---" * (11 + (2 if store else 0)) + "|")
    print(row(f"batched (--max-batch {args.max_batch})", batched))
    print(row("one at a time (--max-batch 1)", single))
    speedup = (batched["tokens"] / batched["wall"]) / (single["tokens"] / single["wall"])
    print(f"batched / one at a time: {speedup:.2f}x tokens/s")
    over = [r for r, h in ((batched, host[args.max_batch]), (single, host[1]))
            if h is not None and r["anon_growth"] > h + device]
    if host[1] is not None:
        print(f"peak RssAnon within the baseline + --host-mem + --device-mem: "
              f"{'yes' if not over else 'NO'}")
    for error in batched["errors"] + single["errors"]:
        print("error:", error, file=sys.stderr)
    return 1 if batched["errors"] or single["errors"] or over else 0


if __name__ == "__main__":
    sys.exit(main())
