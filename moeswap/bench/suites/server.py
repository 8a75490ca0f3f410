"""``--suite server``: a load test of ``moeswap serve`` on loopback, N requests, C at a time,
batched versus one at a time (was scripts/bench_server.py); with ``--chat-turns N``, a chat of N
turns against llama-cpp-python's server instead (moeswap.bench.suites.server_chat).

    moeswap bench -o DIR --suite server [--model M] [--requests 64] [--concurrency 16]
                  [--max-tokens 32] [--max-batch 16] [--ctx 512] [--host-mem SIZE]
                  [--device-mem SIZE] [--step-tokens 512] [--serve-args "--threads 1 --policy lru"]

Each mode, in its own worker (moeswap.bench.worker), starts its own `moeswap serve` process on
127.0.0.1 (a fresh load, a cold expert store), sends the same greedy /v1/completions requests
with httpx, and reports: errors, generated tokens, wall time, tokens/s, latency percentiles,
the server's RSS (from /proc/PID/status: VmRSS once it is ready, the runtime's baseline; VmHWM,
its peak, at the end; and the peak growth of RssAnon, allocated memory, and RssFile, mapped
file pages the kernel can drop, polled every 20 ms) and, when --host-mem turns the expert store
on, the MiB read from disk and the hit rate (from /metrics). --serve-args are further flags for
both servers (split as a shell would); the ones the suite sets itself are refused there.

"one at a time" is `moeswap serve --max-batch 1` with the same client concurrency and --ctx,
so the only difference is batching; its --host-mem is smaller by what the batch charges there
beyond one request (more contexts of KV cache, and the step's working memory:
moeswap.server.budget), so that the room left for experts is the same in both modes. The check
fails (exit status 1) if any request failed or a server's RssAnon grew by more than its
--host-mem plus --device-mem.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from moeswap.bench.suites import server_chat
from moeswap.bench.worker import run_call
from moeswap.errors import MoeswapError
from moeswap.memory import STEP_TOKENS, parse_size

FIELDS = ("VmRSS", "RssAnon", "RssFile")
WORDS = ("the river", "a small engine", "seven lanterns", "the old map", "winter light",
         "a quiet harbour", "the second door", "copper wire")
SET_BY_SUITE = ("--host-mem", "--device-mem", "--step-tokens", "--max-batch", "--ctx", "--queue",
                "--port")


def add_arguments(p) -> None:
    p.add_argument("--model", help="a .gguf MoE file (default: the built-in model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--max-batch", type=int, default=16, help="the batched server's --max-batch")
    p.add_argument("--ctx", type=int, default=None, help="(512; --chat-turns: 4096)")
    p.add_argument("--host-mem", metavar="SIZE",
                   help="the batched server's (the other's is smaller by the batch's charge)")
    p.add_argument("--device-mem", metavar="SIZE")
    p.add_argument("--step-tokens", type=int, default=STEP_TOKENS)
    p.add_argument("--serve-args", default="", metavar="FLAGS",
                   help="more `moeswap serve` flags for both servers, e.g. \"--threads 1 "
                        "--policy lru\"")
    p.add_argument("--timeout", type=float, default=1800, metavar="S", help="per mode")
    server_chat.add_arguments(p)


def prompts(n: int) -> list[str]:
    return [f"Tell me about {WORDS[i % len(WORDS)]}, part {i}." for i in range(n)]


async def fire(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    import httpx

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


def wait_ready(server: subprocess.Popen, url: str) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while True:
        if server.poll() is not None:
            raise MoeswapError(f"moeswap serve exited {server.returncode}: "
                               f"{server.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise MoeswapError("moeswap serve did not answer /health within 120 s")
        time.sleep(0.1)


def run_mode(model: str, serve_flags: list[str], max_batch: int, ctx: int, requests: int,
             concurrency: int, max_tokens: int) -> dict:
    """One server, in a worker: start it, load it, read its memory and metrics, stop it."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moeswap", "serve", model, "--port", str(port),
         "--max-batch", str(max_batch), "--queue", str(requests), "--ctx", str(ctx),
         *serve_flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(server, url)
        baseline = {f: proc_status_bytes(server.pid, f) for f in FIELDS}
        peaks = dict(baseline)
        sampling = threading.Event()

        def sample() -> None:  # /proc has no peak per kind of memory: poll it
            while not sampling.wait(0.02):
                for f in FIELDS:
                    peaks[f] = max(peaks[f], proc_status_bytes(server.pid, f))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        result = asyncio.run(fire(url, served, prompts(requests), concurrency, max_tokens))
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


def host_budgets(args, model: str) -> dict[int, int | None]:
    """--max-batch -> its --host-mem: the same room for experts with one request a step."""
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.server.batching import BatchOptions
    from moeswap.server.budget import batch_charge

    if not args.host_mem:
        return {args.max_batch: None, 1: None}
    config = config_from_gguf(GGUFFile.open(model))
    # shared weights and staging are the same in both modes: only the batch's terms differ
    charged = {b: batch_charge(BatchOptions(max_batch=b, ctx=args.ctx,
                                            step_tokens=args.step_tokens)).bytes(config, 0, 0)
               for b in (args.max_batch, 1)}
    batched = parse_size(args.host_mem)
    return {args.max_batch: batched, 1: batched - (charged[args.max_batch] - charged[1])}


def row(label: str, r: dict) -> str:
    lat = r["latencies"] or [float("nan")]
    p50, p95 = statistics.median(lat), lat[min(len(lat) - 1, int(0.95 * len(lat)))]
    store = "" if r["disk_bytes"] is None else \
        f" {r['disk_bytes'] / 2**20:.1f} | {r['hit_rate']:.1%} |"
    return (f"| {label} | {len(r['errors'])} | {r['tokens']} | {r['wall']:.2f} | "
            f"{r['tokens'] / r['wall']:.2f} | {p50:.2f} | {p95:.2f} | "
            f"{r['baseline'] / 2**20:.0f} | {r['peak'] / 2**20:.0f} | "
            f"{r['anon_growth'] / 2**20:.1f} | {r['file_growth'] / 2**20:.1f} |{store}")


def run(args, out_dir: Path) -> tuple[dict, str]:
    if args.chat_turns:
        return server_chat.run(args, out_dir)
    args.ctx = args.ctx or 512
    model = args.model or args.default_model
    extra = shlex.split(args.serve_args)
    taken = [w for w in extra if w.split("=", 1)[0] in SET_BY_SUITE]
    if taken:
        raise MoeswapError(f"--serve-args may not set {', '.join(taken)}: the suite sets it "
                           "(use the suite's own option)")
    device = parse_size(args.device_mem) if args.device_mem else 0
    host = host_budgets(args, model)
    common = ["--step-tokens", str(args.step_tokens), *extra,
              *(["--device-mem", args.device_mem] if args.device_mem else [])]
    modes = {}
    for name, batch in (("batched", args.max_batch), ("one at a time", 1)):
        flags = common + ([] if host[batch] is None else ["--host-mem", str(host[batch])])
        r = run_call("moeswap.bench.suites.server:run_mode", dict(
            model=model, serve_flags=flags, max_batch=batch, ctx=args.ctx,
            requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens),
            out_dir / "runs", name.replace(" ", "-"), args.timeout)
        if r.pop("status") != "ok":
            raise MoeswapError(f"{name}: {r['failure']}: {r['error']}")
        modes[name] = {"max_batch": batch, "host_mem": host[batch], **r}
    batched, single = modes["batched"], modes["one at a time"]
    speedup = (batched["tokens"] / batched["wall"]) / (single["tokens"] / single["wall"]) \
        if single["tokens"] else None
    over = [name for name, r in modes.items()
            if r["host_mem"] is not None and r["anon_growth"] > r["host_mem"] + device]
    errors = batched["errors"] + single["errors"]
    body = {"model": model, "requests": args.requests, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "ctx": args.ctx, "serve_flags": common,
            "modes": modes, "speedup": speedup, "over_budget": over,
            "passed": not errors and not over}
    store = " MiB read from disk | hit rate |" if batched["disk_bytes"] is not None else ""
    lines = [f"{args.requests} requests, {args.concurrency} concurrent, {args.max_tokens} tokens "
             f"each, greedy, ctx {args.ctx}; moeswap serve {shlex.join(common)}; --host-mem "
             + " / ".join("-" if h is None else f"{h / 2**20:.1f}MiB" for h in host.values()), "",
             "| mode | errors | tokens | wall s | tokens/s | p50 s | p95 s | baseline RSS MiB "
             f"| peak RSS MiB | RssAnon growth MiB | RssFile growth MiB |{store}",
             "|---" * (11 + (2 if store else 0)) + "|",
             row(f"batched (--max-batch {args.max_batch})", batched),
             row("one at a time (--max-batch 1)", single), "",
             f"batched / one at a time: {'-' if speedup is None else f'{speedup:.2f}x'} tokens/s"]
    if host[1] is not None:
        lines.append(f"peak RssAnon within the baseline + --host-mem + --device-mem: "
                     f"{'yes' if not over else 'NO'}")
    lines += [f"error: {e}" for e in errors]
    return body, "\n".join(lines)
