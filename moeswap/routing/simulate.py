"""Replay a routing trace through cache policies and count hits.

The cache model (docs/TRACES.md, "Cache model"): requests come in one of ``ORDERS``: ``step``
(the engine's: each forward pass layer by layer, one request per distinct expert a layer's
tokens picked, in ascending id, as the expert store's ``group_picks``), ``layer`` (each forward
pass layer by layer, every pick a request) or ``token`` (token by token in trace order, every
pick a request, in router order); a policy may admit or bypass a miss. On a decode-only
trace the three make the same requests, ``step`` in ascending id within a layer. ``per-layer``: each layer has its own cache of
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
ORDERS = ("step", "layer", "token")


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
    order: str = "token"  # how requests were replayed (ORDERS)

    @property
    def hit_rate(self) -> float:
        total = int(self.requests.sum())
        return float(self.hits.sum()) / total if total else 0.0


def _forward_groups(trace: RoutingTrace) -> list[np.ndarray]:
    """The tokens of each forward pass, passes in order, tokens in trace order."""
    forwards = trace.forwards()  # [T]
    order = np.argsort(forwards, kind="stable")
    cuts = np.nonzero(np.diff(forwards[order]))[0] + 1
    return np.split(order, cuts)


def layer_requests(trace: RoutingTrace, layer: int, order: str = "token") -> list[int]:
    """One layer's request stream (``order``: one of ORDERS)."""
    ids = trace.expert_ids[:, layer]  # [T, k]
    if order == "token":
        return ids[ids[:, 0] >= 0].reshape(-1).tolist()
    stream = []
    for tokens in _forward_groups(trace):
        picks = ids[tokens]  # [n, k]
        picks = picks[picks[:, 0] >= 0]
        stream += sorted(set(picks.reshape(-1).tolist())) if order == "step" else \
            picks.reshape(-1).tolist()
    return stream


def global_requests(trace: RoutingTrace, order: str = "token") -> list[tuple[int, int]]:
    """All requests keyed (layer, expert) (``order``: one of ORDERS)."""
    T, L, k = trace.expert_ids.shape
    if order == "token":  # token-major, then layer, then router order
        valid = np.repeat(trace.valid[:, :, None], k, axis=2)  # [T, L, k]
        layer_index = np.broadcast_to(np.arange(L)[None, :, None], (T, L, k))  # [T, L, k]
        return list(zip(layer_index[valid].tolist(), trace.expert_ids[valid].tolist()))
    stream = []
    for tokens in _forward_groups(trace):
        for layer in range(L):
            picks = trace.expert_ids[tokens, layer]  # [n, k]
            picks = picks[picks[:, 0] >= 0].reshape(-1).tolist()
            stream += [(layer, e) for e in (sorted(set(picks)) if order == "step" else picks)]
    return stream


def simulate(trace: RoutingTrace, name: str, factory: PolicyFactory, capacity: int, scope: str,
             slots: bool = False, order: str = "token") -> SimResult:
    """Hit counts of one policy at one capacity over the whole trace: experts per layer, or
    with ``slots`` slots in total; requests in ``order`` (one of ORDERS)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    L = trace.n_layers
    hits, requests = np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64)
    if scope == "per-layer":
        for layer in range(L):
            stream = layer_requests(trace, layer, order)
            size = capacity // L + (layer < capacity % L) if slots else capacity
            hits[layer] = _replay(factory(CacheContext(size, stream, layer, trace.k)), stream)
            requests[layer] = len(stream)
    elif scope == "global":
        stream = global_requests(trace, order)
        policy = factory(CacheContext(capacity if slots else capacity * L, stream, None, trace.k))
        for key in stream:
            requests[key[0]] += 1
            hits[key[0]] += policy.access(key).hit
    else:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    return SimResult(name, capacity, scope, hits, requests, slots, order)


def _replay(policy: CachePolicy, stream: list[Key]) -> int:
    access = policy.access
    return sum(access(key).hit for key in stream)


def render_results(results: list[SimResult], console) -> None:
    """Hit rates: one row per policy, one column per capacity."""
    from rich.table import Table

    capacities = sorted({r.capacity for r in results})
    scope = results[0].scope if results else ""
    unit = "slots in total" if results and results[0].slots else "experts per layer"
    order = results[0].order if results else ""
    table = Table(title=f"hit rate, {scope} cache (capacity = {unit}), {order} order")
    table.add_column("policy")
    for c in capacities:
        table.add_column(str(c), justify="right")
    by_key = {(r.policy, r.capacity): r for r in results}
    for policy in dict.fromkeys(r.policy for r in results):
        # four decimals of the rate: comparable with published figures without --json
        table.add_row(policy, *(f"{by_key[policy, c].hit_rate:.2%}" for c in capacities))
    console.print(table)


def results_json(results: list[SimResult]) -> list[dict]:
    return [{"policy": r.policy, "capacity": r.capacity, "slots": r.slots, "order": r.order,
             "scope": r.scope,
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
