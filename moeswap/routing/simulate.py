"""Replay a routing trace through cache policies and count hits.

The cache model (docs/TRACES.md, "Cache model"): tokens are processed one at a time in
trace order; at each traced layer a token's k chosen experts are k requests, in router
order; a policy may admit or bypass a miss. ``per-layer``: each layer has its own cache of
``capacity`` experts and sees only its layer's requests. ``global``: one cache of
``capacity x L`` slots sees every request, keyed (layer, expert), token-major then layer.
With ``slots`` the capacity counts slots in total, the unit memory budgets come in: one global
cache of that many, or per-layer caches sharing them out evenly (the first layers take the
remainder).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moeswap.routing.policies import CachePolicy, Key
from moeswap.routing.traces import RoutingTrace

SCOPES = ("per-layer", "global")


@dataclass(frozen=True)
class CacheContext:
    """What a policy factory may know about the cache it builds."""

    capacity: int
    requests: list  # the whole request stream this cache will see (only offline policies may use it)
    layer: int | None  # traced layer index of a per-layer cache; None for the global cache
    k: int  # requests per token and layer
    # the live store's host tier: keys its device tier already pinned, not to pin twice
    held_faster: frozenset = frozenset()

    def layer_of(self, key: Key) -> int:
        return key[0] if self.layer is None else self.layer


PolicyFactory = Callable[[CacheContext], CachePolicy]


@dataclass(frozen=True)
class SimResult:
    policy: str
    capacity: int
    scope: str
    hits: np.ndarray  # [L] hits per traced layer
    requests: np.ndarray  # [L] requests per traced layer
    slots: bool = False  # capacity counts slots in total, not experts per layer

    @property
    def hit_rate(self) -> float:
        total = int(self.requests.sum())
        return float(self.hits.sum()) / total if total else 0.0


def layer_requests(trace: RoutingTrace, layer: int) -> list[int]:
    """One layer's request stream: each recorded token's k experts in router order."""
    ids = trace.expert_ids[:, layer]  # [T, k]
    return ids[ids[:, 0] >= 0].reshape(-1).tolist()


def global_requests(trace: RoutingTrace) -> list[tuple[int, int]]:
    """All requests keyed (layer, expert), token-major then layer then router order."""
    T, L, k = trace.expert_ids.shape
    valid = np.repeat(trace.valid[:, :, None], k, axis=2)  # [T, L, k]
    layer_index = np.broadcast_to(np.arange(L)[None, :, None], (T, L, k))  # [T, L, k]
    return list(zip(layer_index[valid].tolist(), trace.expert_ids[valid].tolist()))


def simulate(trace: RoutingTrace, name: str, factory: PolicyFactory, capacity: int, scope: str,
             slots: bool = False) -> SimResult:
    """Hit counts of one policy at one capacity over the whole trace: experts per layer, or
    with ``slots`` slots in total."""
    L = trace.n_layers
    hits, requests = np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64)
    if scope == "per-layer":
        for layer in range(L):
            stream = layer_requests(trace, layer)
            size = capacity // L + (layer < capacity % L) if slots else capacity
            hits[layer] = _replay(factory(CacheContext(size, stream, layer, trace.k)), stream)
            requests[layer] = len(stream)
    elif scope == "global":
        stream = global_requests(trace)
        policy = factory(CacheContext(capacity if slots else capacity * L, stream, None, trace.k))
        for key in stream:
            requests[key[0]] += 1
            hits[key[0]] += policy.access(key).hit
    else:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    return SimResult(name, capacity, scope, hits, requests, slots)


def _replay(policy: CachePolicy, stream: list[Key]) -> int:
    access = policy.access
    return sum(access(key).hit for key in stream)


def render_results(results: list[SimResult], console) -> None:
    """Hit rates: one row per policy, one column per capacity."""
    from rich.table import Table

    capacities = sorted({r.capacity for r in results})
    scope = results[0].scope if results else ""
    unit = "slots in total" if results and results[0].slots else "experts per layer"
    table = Table(title=f"hit rate, {scope} cache (capacity = {unit})")
    table.add_column("policy")
    for c in capacities:
        table.add_column(str(c), justify="right")
    by_key = {(r.policy, r.capacity): r for r in results}
    for policy in dict.fromkeys(r.policy for r in results):
        # four decimals of the rate: comparable with published figures without --json
        table.add_row(policy, *(f"{by_key[policy, c].hit_rate:.2%}" for c in capacities))
    console.print(table)


def results_json(results: list[SimResult]) -> list[dict]:
    return [{"policy": r.policy, "capacity": r.capacity, "slots": r.slots, "scope": r.scope,
             "hit_rate": r.hit_rate,
             "hits": int(r.hits.sum()), "requests": int(r.requests.sum()),
             "hits_per_layer": r.hits.tolist(), "requests_per_layer": r.requests.tolist()} for r in results]


def capacity_warnings(trace: RoutingTrace, capacities: list[int], scope: str,
                      slots: bool = False) -> list[str]:
    """Capacities at which a cache holds every expert a layer has: only cold misses remain, and
    every policy ties."""
    every = trace.n_experts * (trace.n_layers if slots else 1)
    unit = "slots in total" if slots else "experts per layer"
    return [f"capacity {c} ({unit}) holds all {trace.n_experts} experts of every layer "
            f"({scope} cache): only the first use of each misses, whatever the policy"
            for c in capacities if c >= every]
