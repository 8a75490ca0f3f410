"""``--suite gap``: how much of the LRU-to-Belady gap each policy closes out of sample
(docs/TRACES.md, "Closing the gap to Belady").

    moeswap bench --suite gap [--primary TRACE] [--traces DIR] -o DIR

The primary trace (the built-in model on this repository's own Python sources,
tests/data/stdlib-moe-code) is split into its first and second half of prompts, each scored
with a profile of the other; the real traces of ../shared/traces are paired as the traces
suite pairs them (skipped, and said so, where that folder is absent). Per-layer caches of
k+1 to E/2 experts, requests in token order. Every learned statistic (the learned policy's
reuse table and window, the decay policy's half-life, prior weight and popularity prior)
comes from the profile of the other trace or half. The one timing, ``access_cost``, is the
policies' own cost per request in the store's setting (one global cache keyed (layer, expert),
requests as a decoding engine makes them).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from moeswap.bench.suites import traces as shared_traces

EXISTING = ["lru", "lfu", "s3fifo", "arc", "learned"]  # what the new policy must beat
POLICIES = [*EXISTING, "decay", "belady"]
DEFAULT_PRIMARY = Path(__file__).resolve().parents[3] / "tests" / "data" / "stdlib-moe-code" / "trace.npz"


def add_arguments(p) -> None:
    shared_traces.add_arguments(p)
    p.add_argument("--primary", default=str(DEFAULT_PRIMARY), metavar="TRACE",
                   help=f"the primary trace, split in halves (default: {DEFAULT_PRIMARY})")


def scoring_pairs(primary: Path, traces_dir: Path) -> tuple[list, str]:
    """(label, scored trace, learning trace) of every pair that can be read, and a line saying
    what was skipped ("" when nothing was)."""
    from moeswap.errors import MoeswapError
    from moeswap.routing.profile import halves
    from moeswap.routing.traces import RoutingTrace

    first, second = halves(RoutingTrace.load(primary))
    name = primary.parent.name if primary.name == "trace.npz" else primary.stem
    pairs = [(f"{name} second half (learned on the first)", second, first),
             (f"{name} first half (learned on the second)", first, second)]
    try:
        return pairs + shared_traces.scoring_pairs(traces_dir), ""
    except MoeswapError as e:
        return pairs, f"real traces skipped: {e}"


def capacities(trace) -> list[int]:
    """Per-layer capacities k+1 .. E/2: below k+1 a demand policy cannot keep a token's experts."""
    return list(range(trace.k + 1, max(trace.k + 1, trace.n_experts // 2) + 1))


def pair_report(scored, learning) -> dict:
    """Hit rates of POLICIES on ``scored`` at ``capacities``, learned statistics from ``learning``."""
    from moeswap.routing.policy_specs import simulate_grid
    from moeswap.routing.profile import build_profile

    caps = capacities(scored)
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = Path(tmp) / "profile.json"
        profile = build_profile(learning, budget=0, per_layer=True)
        profile.save(profile_path)
        specs = [f"{p}:{profile_path}" if p in ("learned", "decay") else p for p in POLICIES]
        hits: dict = {p: {} for p in POLICIES}
        requests = {}
        for r in simulate_grid(scored, specs, caps, "per-layer"):
            hits[r.policy.split(":")[0]][r.capacity] = int(r.hits.sum())
            requests[r.capacity] = int(r.requests.sum())
    return {"k": scored.k, "experts": scored.n_experts, "tokens": scored.n_tokens,
            "layers": scored.n_layers, "capacities": caps, "hits": hits, "requests": requests,
            "reuse_window": profile.reuse.window, "decay_half_life": profile.decay.half_life,
            "decay_prior_weight": profile.decay.prior_weight, **gap_summary(hits, requests, caps)}


def gap_summary(hits: dict, requests: dict, caps: list[int]) -> dict:
    """The best existing policy per capacity, and the share of the LRU-to-Belady gap that it and
    ``decay`` close, per capacity and over all capacities (hits summed)."""
    best = {c: max(EXISTING, key=lambda p: hits[p][c]) for c in caps}

    def closed(policy_hits: int, lru: int, belady: int) -> float | None:
        return (policy_hits - lru) / (belady - lru) if belady > lru else None

    total = {p: sum(hits[p][c] for c in caps) for p in POLICIES}
    best_total = max(EXISTING, key=total.__getitem__)
    return {
        "best_existing": best,
        "gap_closed": {c: {"decay": closed(hits["decay"][c], hits["lru"][c], hits["belady"][c]),
                           "best existing": closed(hits[best[c]][c], hits["lru"][c], hits["belady"][c])}
                       for c in caps},
        "overall": {"best existing": best_total,
                    "decay minus best existing (hits)": total["decay"] - total[best_total],
                    "requests": sum(requests[c] for c in caps),
                    "gap closed, decay": closed(total["decay"], total["lru"], total["belady"]),
                    "gap closed, best existing": closed(total[best_total], total["lru"],
                                                        total["belady"])},
    }


def access_cost(trace, repeats: int = 5, max_requests: int = 100_000) -> dict:
    """Microseconds per ``access`` of LRU and decay (with a prior), as the store calls them: one
    cache of L x E/2 slots keyed (layer, expert), the trace's first ``max_requests`` requests
    token by token, as a decoding engine makes them (a prefill's one request per distinct
    expert would be far fewer); policies interleaved, ``repeats`` times, medians."""
    from moeswap.routing import policies as p
    from moeswap.routing.decay import DecayFit, decay_factory
    from moeswap.routing.simulate import CacheContext, global_requests
    from moeswap.routing.stats import popularity

    stream = global_requests(trace, "token")[:max_requests]
    ctx = CacheContext(trace.n_layers * trace.n_experts // 2, stream, None, trace.k)
    makers = {"lru": lambda: p.LRU(ctx.capacity),
              "decay": lambda: decay_factory(DecayFit(16.0, 0.5), popularity(trace))(ctx)}
    times: dict = {name: [] for name in makers}
    for _ in range(repeats):
        for name, make in makers.items():
            access = make().access
            start = time.perf_counter()
            for key in stream:
                access(key)
            times[name].append((time.perf_counter() - start) / len(stream) * 1e6)
    return {"slots": ctx.capacity, "requests": len(stream),
            "us_per_access": {name: statistics.median(t) for name, t in times.items()}}


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def markdown(pairs: list[dict], skipped: str) -> str:
    lines = [("| scored trace | best existing (all capacities) | decay − it (hits) | gap closed: "
              "decay | gap closed: best existing |"), "|---|---|---:|---:|---:|"]
    for pair in pairs:
        o = pair["overall"]
        lines.append(f"| {pair['label']} | {o['best existing']} | "
                     f"{o['decay minus best existing (hits)']:+d} of {o['requests']} | "
                     f"{_share(o['gap closed, decay'])} | {_share(o['gap closed, best existing'])} |")
    lines.append("")
    if skipped:
        lines += [skipped, ""]
    for pair in pairs:
        caps, hits, req = pair["capacities"], pair["hits"], pair["requests"]
        lines += [(f"**{pair['label']}** — top-{pair['k']} of {pair['experts']}, {pair['tokens']} "
                   f"tokens, {pair['layers']} layers; learned: window {pair['reuse_window']} tokens; "
                   f"decay: half-life {pair['decay_half_life']:g} tokens, prior weight "
                   f"{pair['decay_prior_weight']:g}"), "",
                  "| policy | " + " | ".join(str(c) for c in caps) + " |",
                  "|---|" + "---:|" * len(caps)]
        lines += [f"| {p} | " + " | ".join(f"{hits[p][c] / req[c]:.4f}" for c in caps) + " |"
                  for p in POLICIES]
        best = pair["best_existing"]
        lines.append("| best existing | " + " | ".join(best[c] for c in caps) + " |")
        lines.append("| decay − best existing | " + " | ".join(
            f"{(hits['decay'][c] - hits[best[c]][c]) / req[c]:+.4f}" for c in caps) + " |")
        for who in ("decay", "best existing"):
            lines.append(f"| gap closed: {who} | " + " | ".join(
                _share(pair["gap_closed"][c][who]) for c in caps) + " |")
        lines.append("")
    return "\n".join(lines)


def run(args, out_dir: Path) -> tuple[dict, str]:
    from moeswap.routing.traces import RoutingTrace

    primary, traces_dir = Path(args.primary).expanduser(), Path(args.traces).expanduser()
    found, skipped = scoring_pairs(primary, traces_dir)
    pairs = [{"label": label, **pair_report(scored, learning)} for label, scored, learning in found]
    cost = access_cost(RoutingTrace.load(primary))
    text = markdown(pairs, skipped) + (
        "\nCost per request (`access`, µs, median of 5): " + ", ".join(
            f"{name} {us:.2f}" for name, us in cost["us_per_access"].items())
        + f"; one global cache of {cost['slots']} slots, {cost['requests']} requests of the "
          "primary trace token by token.\n")
    return {"primary": str(primary), "traces": str(traces_dir), "skipped": skipped,
            "pairs": pairs, "access_cost": cost}, text
