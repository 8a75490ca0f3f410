"""Run a generated Mixtral-shaped Q8_0 model (>= 2 GB) from disk through the expert store.

Measurements run each in a fresh subprocess (its own RssAnon, page cache dropped for the
experts it reads: cold reads):

    python scripts/offload_check.py rss   --gb 2.2 --experts-share 0.25
        asserts that the growth of anonymous memory (RssAnon, measured after imports) stays
        under the host budget (shared weights + KV cache + staging + the experts' share) + 10 %
    python scripts/offload_check.py table --gb 2.2 --markdown offload.md
        tokens/s and hit rate for expert RAM budgets of 0, 10, 25, 50, 100 % of the routed
        bytes, for each --policies entry
    python scripts/offload_check.py prepare --gb 2.2 --replay FILE.jsonl --profile-from OTHER.jsonl
        imports a recorded trace to replay (moeswap.trace.v1, into --work-dir) and builds a
        routing profile for ``--policies learned:PROFILE`` from another trace, cut to the
        model's MoE layers (trace layer i -> MoE layer i, as --replay-routing maps them)

The model's weights and router are random: its own routing is near-uniform, the worst case for
a cache, not realistic routing. With ``--replay-routing TRACE`` the router's decisions are
replaced by a recorded trace's (docs/OFFLOAD.md, "Replayed routing") and every table row says
"replayed". The file is written once into --work-dir (scripts/bench_decode.py's generator),
under a temporary name renamed when complete.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
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
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # unique: shared folder
        bench.write_mixtral(partial, bench.mixtral_shape(gb, tiny=False))
        partial.rename(path)
    return path


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def prepare(args) -> None:
    """Import the trace to replay; build the learned policy's profile from another trace."""
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.routing.importers import import_trace
    from moeswap.routing.profile import build_profile
    from moeswap.routing.traces import RoutingTrace

    config = config_from_gguf(GGUFFile.open(args.model_path))
    n_layers, work_dir = len(config.moe_layers), Path(args.work_dir).expanduser()
    replay = work_dir / (Path(args.replay).stem + ".npz")
    import_trace(args.replay).save(replay)
    source = import_trace(args.profile_from)
    # The profile must number the model's MoE layers: keep the trace layers the replay drives.
    cut = RoutingTrace(
        model=source.model, arch=source.arch, layers=config.moe_layers, n_experts=source.n_experts,
        k=source.k, prompt_offsets=source.prompt_offsets,
        expert_ids=source.expert_ids[:, :n_layers], weights=source.weights[:, :n_layers],
        prompt_names=source.prompt_names, source=f"{source.source}, layers 0-{n_layers - 1}")
    profile_path = work_dir / f"{Path(args.profile_from).stem}-{n_layers}layers.profile.json"
    budget = n_layers * config.n_expert // 4  # the hot set (used by pinned:, not by learned:)
    build_profile(cut, budget, per_layer=False, source=args.profile_from).save(profile_path)
    print(f"replay: --replay-routing {replay}\nprofile: --policies learned:{profile_path}")


def measure(path: str, share: float, policy: str, threads: int, n_prompt: int, n_gen: int,
            replay: str | None) -> dict:
    """In this process: load with the store, prefill, decode; memory and speed."""
    import torch

    from moeswap.memory import kv_bytes_per_token
    from moeswap.experts.store import ExpertStore, StoreOptions, routed_bytes, shared_bytes
    from moeswap.experts.tiers import slot_bytes
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.models import load_model
    from moeswap.models.quant_experts import ExpertLayout
    from moeswap.routing.replay import RoutingReplay

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
    model = load_model(path, threads=threads, expert_runner=factory,
                       replay=RoutingReplay.load(replay) if replay else None)
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
            "stall_s": stats["total"]["stall_seconds"],
            "routing": "replayed" if replay else "own router (random)"}


def in_subprocess(args, share: float, policy: str) -> dict:
    command = [sys.executable, __file__, "worker", "--model", str(args.model_path),
               "--share", str(share), "--policy", policy, "--threads", str(args.threads),
               "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    if args.replay_routing:
        command += ["--replay-routing", args.replay_routing]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["rss", "table", "prepare", "worker"])
    parser.add_argument("--gb", type=float, default=2.2, help="generated file size (2.2)")
    parser.add_argument("--work-dir", default="/tmp/moeswap-models")
    parser.add_argument("--experts-share", type=float, default=0.25,
                        help="rss mode: share of the routed experts the host budget holds")
    parser.add_argument("--policies", nargs="+", default=["lru", "lfu", "window:64"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--markdown", help="table mode: write the table here too")
    parser.add_argument("--replay-routing", metavar="TRACE",
                        help="replace the router's decisions by this trace's (.npz)")
    parser.add_argument("--replay", help="prepare mode: the trace to import for replay")
    parser.add_argument("--profile-from", help="prepare mode: the trace the learned profile "
                                               "is built from (not the replayed one)")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--share", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "worker":
        print(json.dumps(measure(args.model, args.share, args.policy, args.threads,
                                 args.prompt_tokens, args.gen_tokens, args.replay_routing)))
        return
    args.model_path = generated_model(Path(args.work_dir).expanduser(), args.gb)
    if args.mode == "prepare":
        prepare(args)
        return
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
    lines = ["| routing | policy | expert RAM budget | decode tokens/s | prefill tokens/s | "
             "hit rate | disk read MiB | RssAnon growth MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for policy in args.policies:
        for share in (0.0, 0.10, 0.25, 0.50, 1.0):
            r = in_subprocess(args, share, policy)
            name = policy.split(":")[0] if policy.startswith("learned:") else policy
            lines.append(f"| {r['routing']} | {name} | {share:.0%} | {r['decode_tokens_per_s']:.2f} | "
                         f"{r['prefill_tokens_per_s']:.2f} | {r['hit_rate']:.1%} | "
                         f"{r['disk_mib']:.0f} | {r['rss_anon_growth'] / 2**20:.0f} |")
            print(lines[-1], flush=True)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
