"""``--policy`` names: turn "lru", "window:64", "learned:profile.json" into policy factories.

Kept apart from the simulator so that profiles (which replay traces to choose their
window) and the simulator do not import each other.
"""

from __future__ import annotations

from collections.abc import Iterator

from moeswap.errors import MoeswapError
from moeswap.experts import policies as p
from moeswap.experts.policies import CachePolicy
from moeswap.routing.profile import Profile
from moeswap.routing.simulate import CacheContext, PolicyFactory, SimResult, simulate
from moeswap.routing.traces import RoutingTrace

POLICY_HELP = (
    "lru, lfu, lfuda, arc, s3fifo, belady, window:N (fewest uses in the last N requests), "
    "admit:N (LRU admitting an expert at its N-th request), pinned:PROFILE (the profile's hot set "
    "pinned, LRU for the other slots), learned:PROFILE (evicts by the profile's reuse table)"
)


def policy_factory(spec: str, trace: RoutingTrace) -> PolicyFactory:
    """The factory a ``--policy`` item names (see POLICY_HELP); profiles must match the trace's layers."""
    name, _, arg = spec.partition(":")
    plain = {
        "lru": lambda ctx: p.LRU(ctx.capacity),
        "lfu": lambda ctx: p.LFU(ctx.capacity),
        "lfuda": lambda ctx: p.LFUDA(ctx.capacity),
        "arc": lambda ctx: p.ARC(ctx.capacity),
        "s3fifo": lambda ctx: p.S3FIFO(ctx.capacity),
        "belady": lambda ctx: p.Belady(ctx.capacity, ctx.requests),
    }
    if name in plain and not arg:
        return plain[name]
    if name in ("window", "admit") and arg.isdigit() and int(arg) > 0:
        n = int(arg)
        if name == "window":
            return lambda ctx: p.SlidingWindow(ctx.capacity, n)
        return lambda ctx: p.AdmitAfter(p.LRU(ctx.capacity), n)
    if name in ("pinned", "learned") and arg:
        profile = Profile.load(arg)
        if profile.layers != trace.layers.tolist() or profile.n_experts != trace.n_experts:
            raise MoeswapError(f"{arg}: profile is for layers {profile.layers} with {profile.n_experts} "
                               f"experts, the trace has {trace.layers.tolist()} with {trace.n_experts}; "
                               "profile a trace of this model")
        if name == "learned":
            return lambda ctx: p.LearnedReuse(ctx.capacity, profile.reuse, ctx.k, ctx.layer_of)
        return lambda ctx: _pinned(profile, ctx)
    raise MoeswapError(f"unknown policy {spec!r}; choose from {POLICY_HELP}")


def _pinned(profile: Profile, ctx: CacheContext) -> CachePolicy:
    hot = profile.hot if ctx.layer is None else profile.hot_in_layer(ctx.layer)
    hot = hot[: ctx.capacity]
    return p.Pinned(hot, p.LRU(ctx.capacity - len(hot)))


def simulate_grid(trace: RoutingTrace, specs: list[str], capacities: list[int], scope: str) -> Iterator[SimResult]:
    """Every named policy at every capacity, one result at a time (policy-major).

    All specs (and their profiles) are resolved before the first replay, so a bad one fails fast.
    """
    factories = [(spec, policy_factory(spec, trace)) for spec in specs]
    for spec, factory in factories:
        for capacity in capacities:
            yield simulate(trace, spec, factory, capacity, scope)
