"""``--suite offload``: a generated Mixtral-shaped Q8_0 model (>= 2 GB) run from disk through the
expert store (was scripts/offload_check.py). Every measurement is a scenario run in its own
worker with cold reads (the page cache dropped for the experts it reads), not warmed first.

    moeswap bench --suite offload rss --gb 2.2 --experts-share 0.25 -o DIR
        passes when the growth of anonymous memory (peak RssAnon over the worker's first sample,
        taken after imports) stays under the host budget + 10 %
    moeswap bench --suite offload table --gb 2.2 -o DIR
        tokens/s and hit rate for expert RAM budgets of 0, 10, 25, 50, 100 % of the routed
        experts, for each --policies entry
    moeswap bench --suite offload prepare --gb 2.2 --replay FILE.jsonl --profile-from OTHER.jsonl
        imports a recorded trace to replay (into --work-dir) and builds a routing profile for
        ``--policies learned:PROFILE`` from another trace, cut to the model's MoE layers (trace
        layer i -> MoE layer i, as --replay-routing maps them)

The model's weights and router are random: its own routing is near-uniform, the worst case for
a cache. With ``--replay-routing TRACE`` a recorded trace's decisions replace the router's
(docs/OFFLOAD.md, "Replayed routing") and every row says "replayed". The host budget of a share
is what the store charges (moeswap.memory.HostCharge: shared weights, staging, the KV cache and
a step's working memory) plus that share of the routed experts' slots.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moeswap.bench.scenarios import ModelFacts, RunSpec, store_charge
from moeswap.bench.worker import run_isolated
from moeswap.errors import MoeswapError

SHARES = (0.0, 0.10, 0.25, 0.50, 1.0)


def add_arguments(p) -> None:
    p.add_argument("mode", choices=["rss", "table", "prepare"])
    p.add_argument("--gb", type=float, default=2.2, help="generated file size (2.2)")
    p.add_argument("--model", help="run this GGUF instead of the generated one")
    p.add_argument("--work-dir", default="/tmp/moeswap-models")
    p.add_argument("--experts-share", type=float, default=0.25,
                   help="rss: share of the routed experts the host budget holds (0.25)")
    p.add_argument("--policies", nargs="+", default=["lru", "lfu", "window:64"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=16, help="decode steps after the prompt")
    p.add_argument("--replay-routing", metavar="TRACE",
                   help="replace the router's decisions by this trace's (.npz)")
    p.add_argument("--replay", help="prepare: the trace to import for replay")
    p.add_argument("--profile-from", help="prepare: the trace the learned profile is built "
                                          "from (not the replayed one)")
    p.add_argument("--timeout", type=float, default=1800, metavar="S")


def measure_share(path: str, share: float, policy: str, threads: int, n_prompt: int, n_gen: int,
                  replay: str | None, folder: Path, name: str,
                  timeout_s: float | None = None) -> dict:
    """One load, prefill and ``n_gen`` decode steps with ``share`` of the routed experts'
    slots in the host budget -> memory, speed and the store's counters."""
    import torch

    from moeswap.experts.settings import OffloadSettings
    from moeswap.experts.store import routed_bytes
    from moeswap.formats.gguf_file import GGUFFile

    facts = ModelFacts.of(path)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, facts.config.n_vocab, (n_prompt,), generator=generator).tolist()
    # gen_tokens counts the token the prompt's forward yields: n_gen decode forwards follow it
    base = RunSpec("offload", f"{policy}, {share:.0%} of the experts", "moeswap", str(path),
                   threads, [ids], n_gen + 1, n_prompt + n_gen + 1, replay_routing=replay,
                   prefill_chunk=n_prompt, warm_page_cache=False)
    slots = int(share * facts.moe_layers * facts.n_expert)
    budget = facts.budget(0, store_charge(base)) + slots * facts.slot_bytes
    spec = replace(base, offload=OffloadSettings(host_bytes=budget, policy=policy,
                                                 cold_reads=True), budget_bytes=budget)
    r = run_isolated(spec, folder, name, timeout_s)
    if r["status"] != "ok":
        raise MoeswapError(f"{spec.label}: {r['failure']}: {r['error']}")
    gguf = GGUFFile.open(path)
    return {"policy": policy, "experts_share": share, "host_budget": budget,
            "shared_bytes": facts.shared_bytes,
            "routed_bytes": routed_bytes(gguf, facts.config.moe_layers),
            "rss_anon_growth": r["peak_anon_bytes"] - r["memory_trace"][0]["rss_anon"],
            "prefill_tokens_per_s": r["prompt_tok_s"], "decode_tokens_per_s": r["decode_tok_s"],
            "hit_rate": r["hit_rate"], "disk_mib": r["store"]["disk_bytes"] / 2**20,
            "stall_s": r["store"]["stall_seconds"],
            "routing": "replayed" if replay else "own router (random)"}


def prepare(args, model: Path) -> tuple[dict, str]:
    """Import the trace to replay; build the learned policy's profile from another trace."""
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.routing.importers import import_trace
    from moeswap.routing.profile import build_profile
    from moeswap.routing.traces import RoutingTrace

    if not (args.replay and args.profile_from):
        raise MoeswapError("prepare needs --replay TRACE and --profile-from TRACE")
    config = config_from_gguf(GGUFFile.open(model))
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
    profile = work_dir / f"{Path(args.profile_from).stem}-{n_layers}layers.profile.json"
    budget = n_layers * config.n_expert // 4  # the hot set (used by pinned:, not by learned:)
    build_profile(cut, budget, per_layer=False, source=args.profile_from).save(profile)
    body = {"model": str(model), "replay": str(replay), "profile": str(profile)}
    return body, f"replay: --replay-routing {replay}\nprofile: --policies learned:{profile}"


def rss_text(r: dict, limit: float) -> str:
    verdict = "PASS" if r["rss_anon_growth"] <= limit else "FAIL"
    return (f"{verdict}: RssAnon grew {r['rss_anon_growth'] / 2**20:.0f} MiB; host budget "
            f"{r['host_budget'] / 2**20:.0f} MiB (of which shared weights "
            f"{r['shared_bytes'] / 2**20:.0f} MiB) + 10 % = {limit / 2**20:.0f} MiB; "
            f"routed experts {r['routed_bytes'] / 2**20:.0f} MiB")


def table_row(r: dict) -> str:
    name = r["policy"].split(":")[0] if r["policy"].startswith("learned:") else r["policy"]
    return (f"| {r['routing']} | {name} | {r['experts_share']:.0%} | "
            f"{r['decode_tokens_per_s']:.2f} | {r['prefill_tokens_per_s']:.2f} | "
            f"{r['hit_rate']:.1%} | {r['disk_mib']:.0f} | {r['rss_anon_growth'] / 2**20:.0f} |")


def run(args, out_dir: Path) -> tuple[dict, str]:
    from moeswap.bench.generated import mixtral_of_size

    model = Path(args.model) if args.model else \
        mixtral_of_size(Path(args.work_dir).expanduser(), args.gb)
    if args.mode == "prepare":
        return prepare(args, model)

    def measure(share: float, policy: str) -> dict:
        name = f"{policy.split(':')[0]}-{share:g}"
        return measure_share(str(model), share, policy, args.threads, args.prompt_tokens,
                             args.gen_tokens, args.replay_routing, out_dir / "runs", name,
                             args.timeout)

    if args.mode == "rss":
        r = measure(args.experts_share, args.policies[0])
        limit = 1.10 * r["host_budget"]
        return {"model": str(model), "passed": r["rss_anon_growth"] <= limit, "result": r}, \
            rss_text(r, limit)
    lines = ["| routing | policy | expert RAM budget | decode tokens/s | prefill tokens/s | "
             "hit rate | disk read MiB | RssAnon growth MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for policy in args.policies:
        for share in SHARES:
            rows.append(measure(share, policy))
            lines.append(table_row(rows[-1]))
    return {"model": str(model), "results": rows}, "\n".join(lines)
