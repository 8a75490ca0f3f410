"""moeswap's own plan: what each tier holds under the user's budgets, and the speed that gives.

The accounting is the expert store's (docs/OFFLOAD.md): the host budget carries the shared
weights, the KV cache the store charges (its float32 upper bound), a forward's working memory
and a staging ring of top-k slots; what is left, and the whole device budget, are expert
slots of ``slot_bytes``; every other expert stays in the file. Decode is bandwidth-bound
(DESIGN.md §4), so a step costs the bytes it reads from each tier over that tier's rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from moeswap.errors import MoeswapError
from moeswap.experts.cost import TOKENS_PER_READ
from moeswap.memory import STEP_TOKENS, HostCharge, format_size
from moeswap.planner.rates import PlanRates
from moeswap.planner.replayed import check_trace, lru_hit_rate
from moeswap.planner.sizes import ModelSizes
from moeswap.routing.profile import Profile
from moeswap.routing.traces import RoutingTrace

PREFILL_PIECE = 32  # tokens per kernel call (moeswap.quant.kernels.MAX_TOKENS_PER_CALL)
Q4_K_M_BITS = 4.85  # bits per weight of a typical Q4_K_M file, for the "lower-bit quant" advice
THRASH = ("no hits: fewer expert slots than one token's k x MoE-layer requests, which an LRU "
          "cycles through (pin a profile's hot set with --profile to do better)")
DENSE = "a dense model: no routed experts, every weight stays in RAM"
NO_PROFILE_HIT = ("no profile: uniform routing assumed, so the hit rate is the resident share "
                  "of all experts (give --profile for the model's real skew)")


@dataclass(frozen=True)
class Budget:
    device_bytes: int
    host_bytes: int
    context: int  # positions per sequence
    batch: int = 1  # sequences decoded together
    step_tokens: int = STEP_TOKENS  # most tokens one forward feeds (--step-tokens; 0: a context)
    kv_type: str = "f32"  # of the KV cache (--kv-type; moeswap.memory.KV_TYPES)

    @property
    def charge(self) -> HostCharge:
        """What the store charges the host budget for these sequences (moeswap.memory)."""
        return HostCharge.for_batch(self.context, self.batch, self.step_tokens, self.kv_type)


@dataclass(frozen=True)
class HitRates:
    device: float  # share of expert requests served by the device tier
    host: float
    source: str

    @property
    def total(self) -> float:
        return self.device + self.host


@dataclass(frozen=True)
class Plan:
    sizes: ModelSizes
    budget: Budget
    rates: PlanRates
    host_charged: int  # what the host budget pays before its first expert slot, of which:
    kv_bytes: int  # the cache as the store charges it (float32, every position)
    working_bytes: int  # a forward's activations, scores and logits, as the store charges them
    staging_bytes: int
    device_slots: int
    host_slots: int
    resident_by_layer: dict[int, int]  # experts kept in a tier, per MoE layer
    hits: HitRates
    decode_tokens_per_second: float
    prefill_tokens_per_second: float

    @property
    def all_experts(self) -> int:
        return self.sizes.n_expert * len(self.sizes.moe_layers)

    @property
    def resident_experts(self) -> int:
        return sum(self.resident_by_layer.values())

    @property
    def disk_expert_bytes(self) -> int:
        return sum((self.sizes.n_expert - self.resident_by_layer[layer]) * size
                   for layer, size in self.sizes.expert_bytes_by_layer.items())


def check_fits(sizes: ModelSizes, budget: Budget) -> None:
    """Refuse a host budget below what the store charges, saying by how much and what to change."""
    terms, need = sizes.host_terms(budget.charge), sizes.host_charged(budget.charge)
    kv, working, staging = terms["kv_bytes"], terms["working_bytes"], terms["staging_bytes"]
    if budget.host_bytes >= need:
        return
    short = need - budget.host_bytes

    def largest(field: str, below: int) -> int:
        """The largest value under ``below`` of one budget field that fits (0: none does);
        the charge grows with each of them."""
        lo, hi = 0, below - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            tried = replace(budget, **{field: mid})
            lo, hi = (mid, hi) if sizes.host_charged(tried.charge) <= budget.host_bytes else \
                (lo, mid - 1)
        return lo

    fixes = [f"--host-mem {format_size(need)} or more"]
    if context := largest("context", budget.context):
        fixes.append(f"a shorter context: --ctx {context} fits")
    if budget.batch > 1:
        batch = largest("batch", budget.batch)
        fixes.append(f"a smaller --batch: {batch} fits" if batch else "a smaller --batch")
    step = min(budget.step_tokens or budget.context, budget.context)
    if working and (step_tokens := largest("step_tokens", step)):
        fixes.append(f"fewer tokens per forward: --step-tokens {step_tokens} fits")
    bits = sizes.shared_bits_per_weight
    if bits > Q4_K_M_BITS + 0.5:
        smaller = int(sizes.shared_bytes * Q4_K_M_BITS / bits)
        fixes.append(f"a lower-bit quant: the shared weights are {bits:.1f} bits per weight; "
                     f"in Q4_K_M they would be about {gib(smaller)}")
    raise MoeswapError(
        f"{sizes.path}: does not fit: --host-mem {gib(budget.host_bytes)} is {gib(short)} short "
        f"of the shared weights ({gib(sizes.shared_bytes)}) + the KV cache for "
        f"{budget.batch} x {budget.context} positions ({gib(kv)}) + a forward's working memory "
        f"({gib(working)}) + {max(sizes.top_k, 1)} "
        f"staging slots ({gib(staging)}), which stay in RAM; routed experts can all be left on "
        f"disk already. Change: " + "; or ".join(fixes))


def expected_hits(sizes: ModelSizes, device_slots: int, host_slots: int,
                  profile: Profile | None) -> tuple[HitRates, dict[int, int]]:
    """Hit rates and experts resident per layer. With a profile the slots hold the experts the
    profile's trace used most (what ``--policy pinned:PROFILE`` keeps); without one, uniform."""
    layers, n_expert = sizes.moe_layers, sizes.n_expert
    slots = min(device_slots + host_slots, n_expert * len(layers))
    if profile is None:
        per_layer = {layer: slots // len(layers) + (i < slots % len(layers))
                     for i, layer in enumerate(layers)}
        if slots < sizes.top_k * len(layers):
            # One token asks k experts of every layer in turn: an LRU over fewer slots than
            # that evicts each expert before the next token asks again.
            return HitRates(0.0, 0.0, THRASH), per_layer
        device = min(device_slots, slots) / (n_expert * len(layers))
        return HitRates(device, slots / (n_expert * len(layers)) - device, NO_PROFILE_HIT), per_layer
    check_profile(sizes, profile)
    counts = np.asarray(profile.counts, dtype=np.int64)  # [L traced, E]
    order = sorted(((-int(counts[i, e]), profile.layers[i], e)
                    for i in range(len(profile.layers)) for e in range(n_expert)))
    chosen = order[:slots]
    total = max(int(counts.sum()), 1)
    device = -sum(c for c, _, _ in chosen[:device_slots]) / total
    host = -sum(c for c, _, _ in chosen[device_slots:]) / total
    per_layer = {layer: 0 for layer in layers}
    for _, layer, _ in chosen:
        per_layer[layer] += 1
    return HitRates(device, host, f"profile {profile.source or profile.model}: the slots "
                                  "hold its most used experts"), per_layer


def check_profile(sizes: ModelSizes, profile: Profile) -> None:
    profile.check_fits(sizes.moe_layers, sizes.n_expert, str(sizes.path))


def replayed_hits(sizes: ModelSizes, device_slots: int, host_slots: int,
                  trace: RoutingTrace) -> tuple[HitRates, dict[int, int]]:
    """The store's LRU replayed over a recorded trace (``planner.replayed``). The device tier's
    share of the hits is its share of the slots; residency per layer changes as the LRU runs,
    so the table shows the slots spread evenly."""
    name = trace.source or "the trace"
    check_trace(sizes, trace, name)
    layers = sizes.moe_layers
    slots = min(device_slots + host_slots, sizes.n_expert * len(layers))
    per_layer = {layer: slots // len(layers) + (i < slots % len(layers))
                 for i, layer in enumerate(layers)}
    rate, requests = lru_hit_rate(trace, slots)
    device = rate * min(device_slots, slots) / slots if slots else 0.0
    return HitRates(device, rate - device, f"{name}: the store's LRU replayed over its "
                                           f"{requests} decode requests"), per_layer


def step_seconds(sizes: ModelSizes, hits: HitRates, plan_rates: PlanRates, n_tokens: int,
                 context: int, sequences: int) -> float:
    """Seconds of one forward step over ``n_tokens`` tokens with ``sequences`` caches of
    ``context`` positions: every read's bytes over its tier's rate, plus fixed costs.

    A product reads its weights once per TOKENS_PER_READ tokens (experts/cost.py). Of a
    layer's E experts, T tokens picking k each use E(1 - (1 - k/E)^T) distinct ones; a miss is
    read from the file, one cold read per piece as the store reads it (the probe's time for a
    read of that size), and computed where it lies (the cost model's choice on a CPU). Each
    block and each expert served add the probe's fixed step costs: on a small model they
    dominate."""
    rates, fixed = plan_rates.rates, plan_rates.overheads
    reads = math.ceil(n_tokens / TOKENS_PER_READ)
    seconds = sizes.active_shared_bytes * reads / rates.host_compute
    seconds += sizes.config.n_layer * fixed.layer_step
    n, k = sizes.n_expert, sizes.top_k
    if n and k:
        distinct = n * (1 - (1 - k / n) ** n_tokens)
        expert_reads = math.ceil(n_tokens * k / distinct / TOKENS_PER_READ)
        miss = max(1.0 - hits.total, 0.0)
        for layer, size in sizes.expert_bytes_by_layer.items():
            compute = (hits.device / rates.device_compute
                       + (hits.host + miss) / rates.host_compute) * expert_reads
            read = sum(map(plan_rates.read_seconds, sizes.expert_pieces_by_layer[layer]))
            seconds += distinct * (size * compute + miss * read + fixed.expert_call)
    seconds += sizes.kv_bytes(context, 4, sequences) / rates.host_compute  # attention reads the cache
    return seconds


def make_plan(sizes: ModelSizes, budget: Budget, rates: PlanRates,
              profile: Profile | None = None, trace: RoutingTrace | None = None) -> Plan:
    """``profile``: the slots hold its hot set (``--policy pinned``); ``trace``: the store's LRU
    replayed over it (wins over ``profile`` for the hit rate); neither: uniform routing."""
    if budget.context < 1 or budget.batch < 1:
        raise MoeswapError(f"--ctx and --batch must be at least 1 (got {budget.context}, "
                           f"{budget.batch})")
    check_fits(sizes, budget)
    terms, charged = sizes.host_terms(budget.charge), sizes.host_charged(budget.charge)
    all_experts = sizes.n_expert * len(sizes.moe_layers)
    device_slots = min(budget.device_bytes // sizes.slot_bytes, all_experts) if all_experts else 0
    host_slots = (min((budget.host_bytes - charged) // sizes.slot_bytes, all_experts - device_slots)
                  if all_experts else 0)
    if not all_experts:  # a dense model: every weight is shared and stays in RAM
        hits, per_layer = HitRates(0.0, 0.0, DENSE), {}
    elif trace is not None:
        hits, per_layer = replayed_hits(sizes, device_slots, host_slots, trace)
    else:
        hits, per_layer = expected_hits(sizes, device_slots, host_slots, profile)
    decode = budget.batch / step_seconds(sizes, hits, rates, budget.batch, budget.context,
                                         budget.batch)
    piece = min(PREFILL_PIECE, budget.context)
    prefill = piece / step_seconds(sizes, hits, rates, piece, 0, 1)
    return Plan(sizes, budget, rates, charged, terms["kv_bytes"], terms["working_bytes"],
                terms["staging_bytes"], device_slots, host_slots, per_layer, hits, decode, prefill)


def gib(n_bytes: float) -> str:
    """Bytes for people: GiB above one, else MiB, else KiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.2f} {unit}"
    return f"{int(n_bytes)} B"
