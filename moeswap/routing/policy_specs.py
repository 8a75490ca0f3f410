"""``--policy`` names: turn "lru", "window:64", "learned:profile.json" into policy factories.

Kept apart from the simulator so that profiles (which replay traces to choose their
window) and the simulator do not import each other.
"""

from __future__ import annotations

from collections.abc import Iterator

from moeswap.errors import MoeswapError
from moeswap.routing import policies as p
from moeswap.routing.decay import DecayAdmit, DecayFit, decay_factory, popularity_prior
from moeswap.routing.policies import CachePolicy
from moeswap.routing.profile import Profile
from moeswap.routing.simulate import CacheContext, PolicyFactory, SimResult, simulate
from moeswap.routing.traces import RoutingTrace

POLICY_HELP = (
    "lru, lfu, lfuda, arc, s3fifo, belady (simulation only: the optimum when a miss may bypass "
    "the cache), belady-admit (simulation only: every miss admitted, the classic OPT), "
    "window:N (fewest uses in the last N "
    "requests), admit:N (LRU admitting an expert at its N-th request), pinned:PROFILE (the "
    "profile's hot set pinned, LRU for the other slots), learned:PROFILE (evicts the expert "
    "whose next use the profile's reuse table expects last), decay (decayed use counts, a miss "
    "admitted only if it scores at least its victim; half-life 16 tokens), decay:PROFILE (the "
    "profile's half-life and popularity prior)"
)

_PLAIN = {
    "lru": lambda ctx: p.LRU(ctx.capacity),
    "lfu": lambda ctx: p.LFU(ctx.capacity),
    "lfuda": lambda ctx: p.LFUDA(ctx.capacity),
    "arc": lambda ctx: p.ARC(ctx.capacity),
    "s3fifo": lambda ctx: p.S3FIFO(ctx.capacity),
    "belady": lambda ctx: p.Belady(ctx.capacity, ctx.requests),
    "belady-admit": lambda ctx: BeladyAdmit(ctx.capacity, ctx.requests),
    "decay": decay_factory(DecayFit(), None),
}


class BeladyAdmit(p.Belady):
    """Belady's MIN as usually stated: every miss is admitted, evicting the resident whose next
    request lies farthest (a few hits below ``belady``, which may let a miss bypass)."""

    name = "belady-admit"
    may_bypass = False


def policy_factory(spec: str, layers: list[int], n_experts: int, what: str,
                   live: bool = False) -> PolicyFactory:
    """The factory a ``--policy`` item names (see POLICY_HELP).

    ``layers``, ``n_experts``: model block index of each traced (or MoE) layer and experts per
    layer of ``what``, the trace or model file; a profile must match them. ``live``: for the
    expert store, whose keys are (model block, expert) and which cannot see future requests.
    """
    name, _, arg = spec.partition(":")
    if name in ("belady", "belady-admit") and not arg and live:
        raise MoeswapError(f"policy '{name}' needs the future requests, which only a trace has; "
                           "use it with `moeswap simulate`, or pick another policy")
    if name in _PLAIN and not arg:
        return _PLAIN[name]
    if name in ("window", "admit") and arg.isdigit() and int(arg) > 0:
        n = int(arg)
        if name == "window":
            return lambda ctx: p.SlidingWindow(ctx.capacity, n)
        return lambda ctx: p.AdmitAfter(p.LRU(ctx.capacity), n)
    if name in ("pinned", "learned", "decay") and arg:
        profile = Profile.load(arg)
        profile.check_fits(layers, n_experts, what)
        if name == "learned":
            return lambda ctx: p.LearnedReuse(ctx.capacity, profile.reuse, ctx.k, ctx.layer_of)
        if name == "decay":
            return _live_decay(profile) if live else decay_factory(profile.decay, profile.counts)
        return lambda ctx: _pinned(profile, ctx, live)
    raise MoeswapError(f"unknown policy {spec!r}; choose from {POLICY_HELP}")


def _live_decay(profile: Profile) -> PolicyFactory:
    """``decay`` in the store, whose keys are (model block, expert): the prior by block."""
    prior = popularity_prior(profile.counts, profile.decay.prior_weight)  # [L, E], traced layers
    by_key = {(block, e): float(prior[traced, e]) for traced, block in enumerate(profile.layers)
              for e in range(profile.n_experts)}
    return lambda ctx: DecayAdmit(ctx.capacity, ctx.k, profile.decay.half_life, by_key.__getitem__,
                                  ctx.layer_of)


def _pinned(profile: Profile, ctx: CacheContext, live: bool) -> CachePolicy:
    if live:  # the profile numbers traced layers; the store's keys carry model block indices
        hot = [(profile.layers[traced], expert) for traced, expert in profile.hot
               if (profile.layers[traced], expert) not in ctx.held_faster]
    else:
        hot = profile.hot if ctx.layer is None else profile.hot_in_layer(ctx.layer)
    hot = hot[: ctx.capacity]
    return p.Pinned(hot, p.LRU(ctx.capacity - len(hot)))


def live_policy(spec: str, capacity: int, top_k: int, layers: list[int], n_experts: int,
                model: str, held_faster: frozenset = frozenset()) -> CachePolicy:
    """The expert store's policy: room for ``capacity`` experts, keys (model block, expert),
    ``top_k`` requests per token and layer; ``layers``, ``n_experts``: the model's MoE layers;
    ``held_faster``: what a faster tier pinned (a hot set is pinned in one tier only)."""
    factory = policy_factory(spec, layers, n_experts, model, live=True)
    return factory(CacheContext(capacity=capacity, requests=[], layer=None, k=top_k,
                                held_faster=held_faster))


def simulate_grid(trace: RoutingTrace, specs: list[str], capacities: list[int], scope: str,
                  slots: bool = False, order: str = "token") -> Iterator[SimResult]:
    """Every named policy at every capacity (``slots``: in total), requests in ``order``, one
    result at a time (policy-major).

    All specs (and their profiles) are resolved before the first replay, so a bad one fails fast.
    """
    factories = [(spec, policy_factory(spec, trace.layers.tolist(), trace.n_experts, "the trace"))
                 for spec in specs]
    for spec, factory in factories:
        for capacity in capacities:
            yield simulate(trace, spec, factory, capacity, scope, slots, order)
