"""``--suite traces``: the cache-policy table of docs/TRACES.md from the real routing traces in
../shared/traces (was scripts/traces_table.py).

    moeswap bench --suite traces [--traces DIR] -o DIR

Each learned policy is scored on a trace it never saw: the Mixtral profiles swap gsm8k and
humaneval; Switch-base-8 (one trace of 10 prompts) is split into prompts 0-4 and 5-9.
Reports hit rates, per-layer caches of 1-6 experts, and the learned policy's gain over LRU had
each reuse-table window been imposed instead of chosen on the learning trace. A simulation:
nothing is timed, so it runs in this process.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from moeswap.errors import MoeswapError

CAPACITIES = [1, 2, 3, 4, 5, 6]
POLICIES = ["lru", "lfu", "lfuda", "arc", "s3fifo", "learned", "belady"]
WINDOWS = (8, 16, 32, 64, 128)
FILES = ("mixtral-8x7b/gsm8k.jsonl", "mixtral-8x7b/humaneval.jsonl",
         "switch-base-8/router-trace.v2.json")
DEFAULT_TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces"


def add_arguments(p) -> None:
    p.add_argument("--traces", default=str(DEFAULT_TRACES), metavar="DIR",
                   help=f"the real traces (default: ../shared/traces beside the checkout, "
                        f"{DEFAULT_TRACES}): {', '.join(FILES)}")


def scoring_pairs(traces_dir: Path):
    """(label, scored trace, learning trace) for both real traces, each direction."""
    from moeswap.routing.importers import import_trace

    missing = [name for name in FILES if not (traces_dir / name).is_file()]
    if missing:
        found = f"no {', '.join(missing)}" if traces_dir.is_dir() else "no such folder"
        raise MoeswapError(f"{traces_dir}: {found}; the traces suite reads the real routing "
                           "traces of ../shared/traces (give their folder with --traces DIR)")
    gsm8k, humaneval, switch = (import_trace(traces_dir / name) for name in FILES)
    first, second = switch.select_prompts(list(range(5))), switch.select_prompts(list(range(5, 10)))
    return [
        ("Mixtral-8x7B humaneval (learned on gsm8k)", humaneval, gsm8k),
        ("Mixtral-8x7B gsm8k (learned on humaneval)", gsm8k, humaneval),
        ("Switch-base-8 prompts 5-9 (learned on 0-4)", second, first),
        ("Switch-base-8 prompts 0-4 (learned on 5-9)", first, second),
    ]


def hit_rates(scored, learning) -> tuple[dict, dict]:
    """Every policy's hit rate per capacity on ``scored``, the learned one profiled on
    ``learning`` -> ({policy: {capacity: hit rate}}, the profile's facts)."""
    from moeswap.routing.policy_specs import simulate_grid
    from moeswap.routing.profile import build_profile

    with tempfile.TemporaryDirectory() as tmp:
        profile_path = Path(tmp) / "profile.json"
        profile = build_profile(learning, budget=0, per_layer=True)
        profile.save(profile_path)
        specs = [f"learned:{profile_path}" if p == "learned" else p for p in POLICIES]
        rates: dict = {p: {} for p in POLICIES}
        for r in simulate_grid(scored, specs, CAPACITIES, "per-layer"):
            rates[r.policy.split(":")[0]][r.capacity] = r.hit_rate
    return rates, {"k": scored.k, "tokens": scored.n_tokens, "layers": scored.n_layers,
                   "reuse_window": profile.reuse.window}


def imposed_gain(scored, learning, window: int) -> dict:
    """The learned policy's hit rate minus LRU's, per capacity above k, with its reuse table
    learned on ``learning`` at ``window`` tokens."""
    from moeswap.routing.policies import LRU, LearnedReuse
    from moeswap.routing.profile import learn_reuse_table
    from moeswap.routing.simulate import simulate

    table = learn_reuse_table(learning, window=window)

    def learned(ctx):
        return LearnedReuse(ctx.capacity, table, ctx.k, ctx.layer_of)

    def lru(ctx):
        return LRU(ctx.capacity)

    return {c: simulate(scored, "learned", learned, c, "per-layer").hit_rate
            - simulate(scored, "lru", lru, c, "per-layer").hit_rate
            for c in CAPACITIES if c > scored.k}


def markdown(pairs: list[dict]) -> str:
    lines = []
    for pair in pairs:
        rates = pair["hit_rates"]
        lines += [f"**{pair['label']}** — top-{pair['k']}, {pair['tokens']} tokens, "
                  f"{pair['layers']} layers; reuse window chosen on the learning trace: "
                  f"{pair['reuse_window']} tokens", "",
                  "| policy | " + " | ".join(f"{c}" for c in CAPACITIES) + " |",
                  "|---|" + "---:|" * len(CAPACITIES)]
        lines += [f"| {p} | " + " | ".join(f"{rates[p][c]:.1%}" for c in CAPACITIES) + " |"
                  for p in POLICIES]
        for name, high, low in (("learned − lru", "learned", "lru"),
                                ("belady − learned", "belady", "learned")):
            lines.append(f"| {name} | " + " | ".join(
                f"{(rates[high][c] - rates[low][c]) * 100:+.1f}" for c in CAPACITIES) + " |")
        lines.append("")
    lines += ["**Learned policy minus LRU (points) with each window imposed, capacities "
              "k+1..6**", "",
              "| window (tokens) | " + " | ".join(p["label"].split(" (")[0] for p in pairs) + " |",
              "|---|" + "---|" * len(pairs)]
    for window in WINDOWS:
        lines.append(f"| {window} | " + " | ".join(
            " ".join(f"{g * 100:+.1f}" for g in p["imposed_gain"][window].values())
            for p in pairs) + " |")
    return "\n".join(lines)


def run(args, out_dir: Path) -> tuple[dict, str]:
    traces_dir = Path(args.traces).expanduser()
    pairs = []
    for label, scored, learning in scoring_pairs(traces_dir):
        rates, facts = hit_rates(scored, learning)
        pairs.append({"label": label, **facts, "hit_rates": rates,
                      "imposed_gain": {w: imposed_gain(scored, learning, w) for w in WINDOWS}})
    return {"traces": str(traces_dir), "capacities": CAPACITIES, "pairs": pairs}, markdown(pairs)
