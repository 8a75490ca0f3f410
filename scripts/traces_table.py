"""Regenerate the cache-policy table of docs/TRACES.md from the real traces in ../shared/traces.

    python scripts/traces_table.py [TRACES_DIR]

Each learned policy is scored on a trace it never saw: the Mixtral profiles swap gsm8k and
humaneval; Switch-base-8 (one trace of 10 prompts) is split into prompts 0-4 and 5-9.
Prints Markdown: hit rates, per-layer caches of 1-6 experts, and the learned policy's gain
over LRU had each reuse-table window been imposed instead of chosen on the learning trace.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from moeswap.routing.importers import import_trace
from moeswap.routing.profile import build_profile, learn_reuse_table
from moeswap.routing.policy_specs import simulate_grid
from moeswap.routing.simulate import simulate
from moeswap.routing.policies import LRU, LearnedReuse

CAPACITIES = [1, 2, 3, 4, 5, 6]
POLICIES = ["lru", "lfu", "lfuda", "arc", "s3fifo", "learned", "belady"]


def scoring_pairs(traces_dir: Path):
    """(label, scored trace, learning trace) for both real traces, each direction."""
    gsm8k = import_trace(traces_dir / "mixtral-8x7b" / "gsm8k.jsonl")
    humaneval = import_trace(traces_dir / "mixtral-8x7b" / "humaneval.jsonl")
    switch = import_trace(traces_dir / "switch-base-8" / "router-trace.v2.json")
    first, second = switch.select_prompts(list(range(5))), switch.select_prompts(list(range(5, 10)))
    return [
        ("Mixtral-8x7B humaneval (learned on gsm8k)", humaneval, gsm8k),
        ("Mixtral-8x7B gsm8k (learned on humaneval)", gsm8k, humaneval),
        ("Switch-base-8 prompts 5-9 (learned on 0-4)", second, first),
        ("Switch-base-8 prompts 0-4 (learned on 5-9)", first, second),
    ]


def main(traces_dir: Path) -> None:
    pairs = scoring_pairs(traces_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for label, scored, learning in pairs:
            profile_path = Path(tmp) / "profile.json"
            profile = build_profile(learning, budget=0, per_layer=True)
            profile.save(profile_path)
            specs = [f"learned:{profile_path}" if p == "learned" else p for p in POLICIES]
            results = {(r.policy.split(":")[0], r.capacity): r.hit_rate
                       for r in simulate_grid(scored, specs, CAPACITIES, "per-layer")}
            print(f"\n**{label}** — top-{scored.k}, {scored.n_tokens} tokens, {scored.n_layers} layers; "
                  f"reuse window chosen on the learning trace: {profile.reuse.window} tokens\n")
            print("| policy | " + " | ".join(f"{c}" for c in CAPACITIES) + " |")
            print("|---|" + "---:|" * len(CAPACITIES))
            for policy in POLICIES:
                print(f"| {policy} | " + " | ".join(f"{results[policy, c]:.1%}" for c in CAPACITIES) + " |")
            gain = [results["learned", c] - results["lru", c] for c in CAPACITIES]
            gap = [results["belady", c] - results["learned", c] for c in CAPACITIES]
            print("| learned − lru | " + " | ".join(f"{g * 100:+.1f}" for g in gain) + " |")
            print("| belady − learned | " + " | ".join(f"{g * 100:+.1f}" for g in gap) + " |")

    print("\n**Learned policy minus LRU (points) with each window imposed, capacities k+1..6**\n")
    print("| window (tokens) | " + " | ".join(label.split(" (")[0] for label, *_ in pairs) + " |")
    print("|---|" + "---|" * len(pairs))
    for window in (8, 16, 32, 64, 128):
        cells = []
        for _, scored, learning in pairs:
            table = learn_reuse_table(learning, window=window)
            learned = lambda ctx, t=table: LearnedReuse(ctx.capacity, t, ctx.k, ctx.layer_of)  # noqa: E731
            lru = lambda ctx: LRU(ctx.capacity)  # noqa: E731
            cells.append(" ".join(
                f"{(simulate(scored, 'learned', learned, c, 'per-layer').hit_rate - simulate(scored, 'lru', lru, c, 'per-layer').hit_rate) * 100:+.1f}"
                for c in CAPACITIES if c > scored.k))
        print(f"| {window} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[2] / "shared" / "traces"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
