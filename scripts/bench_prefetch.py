"""Prefetch off / gate / history / both on a model run from disk (cold reads) at a small budget.

    python scripts/bench_prefetch.py table  [--model M] [--experts-share 0.25] [--depth 2]
                                            [--tokens 64] [--repeats 5] [--markdown out.md]
        every (mode, repeat) in a fresh subprocess, modes interleaved within each repeat;
        prints medians of decode tokens/s, stall seconds, the stall prefetch hid, reads used
        and wasted, and depth-1 recall, with the spread (min-max over repeats) as the noise band
    python scripts/bench_prefetch.py stress [--model M] [--steps 10000]
        a tiny budget, prefetch both at depth 4 against off: the same tokens for every decode
        step, a constant thread count and RssAnon growth under 16 MiB after the first tenth

The default model is the shipped moeswap/data/stdlib-moe-q8_0.gguf. --experts-share is the share
of the routed experts' bytes the host budget holds beyond shared weights, KV cache and staging.
Run it on a quiet machine: it is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "moeswap" / "data" / "stdlib-moe-q8_0.gguf"
MODES = ("off", "gate", "history", "both")
PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def host_budget(model: Path, share: float, context_tokens: int) -> int:
    from moeswap.experts.options import kv_bytes_per_token
    from moeswap.experts.store import routed_bytes, shared_bytes
    from moeswap.experts.tiers import slot_bytes
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.models.quant_experts import ExpertLayout

    gguf = GGUFFile.open(model)
    config = config_from_gguf(gguf)
    layers = config.moe_layers
    slot = slot_bytes([ExpertLayout.from_file(gguf, i) for i in layers])
    fixed = (shared_bytes(gguf, layers) + kv_bytes_per_token(config) * context_tokens
             + config.n_expert_used * slot)
    return fixed + int(share * routed_bytes(gguf, layers))


def runtime(model: Path, budget: int, mode: str, depth: int, context_tokens: int, threads: int):
    import moeswap
    from moeswap.experts.store import ExpertStore, StoreOptions

    factory = ExpertStore.factory(StoreOptions(
        host_bytes=budget, context_tokens=context_tokens, cold_reads=True,
        prefetch=mode, prefetch_depth=depth if mode != "off" else 0))
    return moeswap.load(model, threads=threads, expert_runner=factory)


def worker(args) -> None:
    """One measurement: prints one JSON line."""
    from moeswap.generate import GenerationStats

    context = 64 + args.tokens
    rt = runtime(args.model, host_budget(args.model, args.experts_share, context), args.mode,
                 args.depth, context, args.threads)
    stats = GenerationStats()
    tokens = list(rt.generate(PROMPT, args.tokens, temperature=0, stats=stats))
    s = rt.stats()
    row = {"mode": args.mode, "tokens": tokens, "tok_s": stats.decode_tokens_per_second,
           "stall_s": s["total"]["stall_seconds"], "disk_mib": s["total"]["disk_bytes"] / 2**20}
    if "prefetch" in s:
        p = s["prefetch"]
        depth1 = [by_depth[1] for by_depth in p["layers"].values() if 1 in by_depth]
        hits, actual = sum(a["hits"] for a in depth1), sum(a["actual"] for a in depth1)
        row.update(hidden_s=p["hidden_seconds"], used=p["used"], reads=p["reads"],
                   wasted_mib=p["bytes_wasted"] / 2**20, recall1=hits / actual if actual else 0)
    print(json.dumps(row))


def table(args) -> None:
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:  # interleaved: slow drifts of the machine hit every mode alike
            done = subprocess.run(
                [sys.executable, __file__, "worker", "--model", str(args.model), "--mode", mode,
                 "--depth", str(args.depth), "--tokens", str(args.tokens), "--experts-share",
                 str(args.experts_share), "--threads", str(args.threads)],
                capture_output=True, text=True, check=True, cwd=ROOT)
            rows[mode].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"repeat {repeat + 1}/{args.repeats} {mode}: {rows[mode][-1]['tok_s']:.1f} tok/s",
                  file=sys.stderr)
    reference = rows["off"][0]["tokens"]
    assert all(r["tokens"] == reference for rs in rows.values() for r in rs), "outputs differ"

    def cell(mode: str, key: str, fmt: str) -> str:
        values = [r[key] for r in rows[mode] if key in r]
        if not values:
            return "-"
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    lines = [f"model {args.model.name}, cold reads, experts share {args.experts_share:.0%}, "
             f"depth {args.depth}, {args.tokens} tokens, medians of {args.repeats} interleaved "
             "repeats (min-max)", "",
             "| prefetch | decode tok/s | stall s | stall hidden s | reads used / issued | "
             "wasted MiB | recall depth 1 |", "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        used = "-"
        if mode != "off":
            used = (f"{statistics.median(r['used'] for r in rows[mode]):.0f} / "
                    f"{statistics.median(r['reads'] for r in rows[mode]):.0f}")
        lines.append(f"| {mode} | {cell(mode, 'tok_s', '.1f')} | {cell(mode, 'stall_s', '.3f')} "
                     f"| {cell(mode, 'hidden_s', '.3f')} | {used} "
                     f"| {cell(mode, 'wasted_mib', '.1f')} | {cell(mode, 'recall1', '.0%')} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def stress(args) -> None:
    runs = {}
    for mode in ("off", "both"):
        rt = runtime(args.model, host_budget(args.model, 0.05, 128), mode, 4, 128, args.threads)
        tokens, threads, rss = [], [], []
        for generation in range(args.steps // 64):
            tokens += list(rt.generate(f"{PROMPT}    # {generation}\n", 64, temperature=0))
            threads.append(threading.active_count())
            rss.append(rss_anon())
        runs[mode] = tokens
        settled = rss[len(rss) // 10]
        print(f"{mode}: {len(tokens)} decode steps, threads {min(threads)}-{max(threads)}, "
              f"RssAnon growth after the first tenth {(max(rss) - settled) / 2**20:.1f} MiB")
        assert len(set(threads)) == 1, threads
        assert max(rss) - settled < 16 * 2**20
    assert runs["off"] == runs["both"], "prefetch changed the output"
    print("identical output, no thread or memory growth")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("table", "worker", "stress"):
        p = sub.add_parser(name)
        p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--depth", type=int, default=2)
        p.add_argument("--tokens", type=int, default=64)
        p.add_argument("--experts-share", type=float, default=0.25)
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--steps", type=int, default=10_000)
        p.add_argument("--mode", choices=MODES, default="both")
        p.add_argument("--markdown")
    args = ap.parse_args()
    {"table": table, "worker": worker, "stress": stress}[args.command](args)


if __name__ == "__main__":
    main()
