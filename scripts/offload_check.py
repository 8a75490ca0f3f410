"""Run a generated Mixtral-shaped Q8_0 model (>= 2 GB) from disk through the expert store.

Two modes, each measurement in a fresh subprocess (its own RssAnon, page cache dropped for the
experts it reads: cold reads):

    python scripts/offload_check.py rss   --gb 2.2 --experts-share 0.25
        asserts that the growth of anonymous memory (RssAnon, measured after imports) stays
        under the host budget (shared weights + KV cache + staging + the experts' share) + 10 %
    python scripts/offload_check.py table --gb 2.2 --markdown offload.md
        tokens/s and hit rate for expert RAM budgets of 0, 10, 25, 50, 100 % of the routed
        bytes, for each --policies entry

The model's weights and router are random: routing is near-uniform, the worst case for a cache,
not realistic routing. The file is written once into --work-dir (scripts/bench_decode.py's
generator).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generated_model(work_dir: Path, gb: float) -> Path:
    spec = importlib.util.spec_from_file_location("bench_decode",
                                                  ROOT / "scripts" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = work_dir / f"mixtral-shaped-{gb:g}gb-q8_0.gguf"
    if not path.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        bench.write_mixtral(partial, bench.mixtral_shape(gb, tiny=False))
        partial.rename(path)
    return path


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def measure(path: str, share: float, policy: str, threads: int, n_prompt: int, n_gen: int) -> dict:
    """In this process: load with the store, prefill, decode; memory and speed."""
    import torch

    from moeswap.experts.options import kv_bytes_per_token
    from moeswap.experts.store import ExpertStore, StoreOptions, routed_bytes, shared_bytes
    from moeswap.experts.tiers import slot_bytes
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.models import load_model
    from moeswap.models.quant_experts import ExpertLayout

    torch.set_num_threads(threads)
    baseline = rss_anon()
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    layers = config.moe_layers
    slot = slot_bytes([ExpertLayout.from_file(gguf, i) for i in layers])
    n_experts = len(layers) * config.n_expert
    fixed = (shared_bytes(gguf, layers) + config.n_expert_used * slot
             + kv_bytes_per_token(config) * (n_prompt + n_gen))
    expert_budget = int(share * n_experts) * slot
    factory = ExpertStore.factory(StoreOptions(
        host_bytes=fixed + expert_budget, context_tokens=n_prompt + n_gen, policy=policy,
        cold_reads=True))
    model = load_model(path, threads=threads, expert_runner=factory)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.n_vocab, (n_prompt,), generator=generator)
    cache = model.new_cache()
    started = time.perf_counter()
    logits = model.forward([ids], [cache])[0]
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(n_gen):
        logits = model.forward([logits[-1:].argmax(-1)], [cache])[0]
    decode = time.perf_counter() - started
    growth = rss_anon() - baseline
    stats = factory.stats()
    return {"policy": policy, "experts_share": share, "host_budget": fixed + expert_budget,
            "shared_bytes": stats["shared_bytes"], "routed_bytes": routed_bytes(gguf, layers),
            "rss_anon_growth": growth, "prefill_tokens_per_s": n_prompt / prefill,
            "decode_tokens_per_s": n_gen / decode, "hit_rate": stats["total"]["hit_rate"],
            "disk_mib": stats["total"]["disk_bytes"] / 2**20,
            "stall_s": stats["total"]["stall_seconds"]}


def in_subprocess(args, share: float, policy: str) -> dict:
    command = [sys.executable, __file__, "worker", "--model", str(args.model_path),
               "--share", str(share), "--policy", policy, "--threads", str(args.threads),
               "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["rss", "table", "worker"])
    parser.add_argument("--gb", type=float, default=2.2, help="generated file size (2.2)")
    parser.add_argument("--work-dir", default="~/.cache/moeswap/offload")
    parser.add_argument("--experts-share", type=float, default=0.25,
                        help="rss mode: share of the routed experts the host budget holds")
    parser.add_argument("--policies", nargs="+", default=["lru", "lfu", "window:64"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--markdown", help="table mode: write the table here too")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--share", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "worker":
        print(json.dumps(measure(args.model, args.share, args.policy, args.threads,
                                 args.prompt_tokens, args.gen_tokens)))
        return
    args.model_path = generated_model(Path(args.work_dir).expanduser(), args.gb)
    if args.mode == "rss":
        r = in_subprocess(args, args.experts_share, args.policies[0])
        limit = 1.10 * r["host_budget"]
        print(json.dumps(r, indent=1))
        verdict = "PASS" if r["rss_anon_growth"] <= limit else "FAIL"
        print(f"{verdict}: RssAnon grew {r['rss_anon_growth'] / 2**20:.0f} MiB; host budget "
              f"{r['host_budget'] / 2**20:.0f} MiB (of which shared weights "
              f"{r['shared_bytes'] / 2**20:.0f} MiB) + 10 % = {limit / 2**20:.0f} MiB; "
              f"routed experts {r['routed_bytes'] / 2**20:.0f} MiB")
        sys.exit(0 if verdict == "PASS" else 1)
    lines = ["| policy | expert RAM budget | decode tokens/s | prefill tokens/s | hit rate | "
             "disk read MiB | RssAnon growth MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for policy in args.policies:
        for share in (0.0, 0.10, 0.25, 0.50, 1.0):
            r = in_subprocess(args, share, policy)
            lines.append(f"| {policy} | {share:.0%} | {r['decode_tokens_per_s']:.2f} | "
                         f"{r['prefill_tokens_per_s']:.2f} | {r['hit_rate']:.1%} | "
                         f"{r['disk_mib']:.0f} | {r['rss_anon_growth'] / 2**20:.0f} |")
            print(lines[-1], flush=True)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
