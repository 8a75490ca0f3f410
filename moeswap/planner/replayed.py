"""The hit rate of the expert store's default policy on a recorded routing trace.

The store asks for experts per layer step: the distinct experts the step's tokens picked, in
ascending id (``group_picks``). A prompt's prefill is one forward, each layer cut into pieces
of MAX_TOKENS_PER_CALL tokens; each decoded token is a step of its own. The replay asks in that
order, through one ``policies.LRU`` of all the slots over keys (layer, expert) — every miss
admitted, the least recently used evicted — and counts the decode steps' hits:
decode speed is what they predict. Each prompt of the trace is replayed as a run of its own,
from an empty cache (``moeswap run`` starts its store empty), and the hit rate pools every
prompt's decode requests. A trace without phases counts every token as a decode step.

Legend: T tokens, L traced layers, k picks per token.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from moeswap.errors import MoeswapError
from moeswap.routing.policies import LRU
from moeswap.planner.sizes import ModelSizes
from moeswap.quant.kernels import MAX_TOKENS_PER_CALL
from moeswap.routing.traces import PHASES, RoutingTrace

DECODE = PHASES.index("decode")


def check_trace(sizes: ModelSizes, trace: RoutingTrace, name: str) -> None:
    if trace.layers.tolist() != sizes.moe_layers or trace.n_experts != sizes.n_expert:
        raise MoeswapError(f"{name}: traced layers {trace.layers.tolist()} with "
                           f"{trace.n_experts} experts, {sizes.path} has {sizes.moe_layers} with "
                           f"{sizes.n_expert}; record a trace of this model "
                           "(moeswap run --trace) over every MoE layer")


def store_requests(trace: RoutingTrace, prompt: int) -> Iterator[tuple[bool, tuple[int, int]]]:
    """(from a decode step, (traced layer, expert)) in the order the store asks, for one
    prompt's run."""
    phase = trace.phase if trace.phase is not None else np.full(trace.n_tokens, DECODE)
    start, end = int(trace.prompt_offsets[prompt]), int(trace.prompt_offsets[prompt + 1])
    prefill = [t for t in range(start, end) if phase[t] != DECODE]
    pieces = [prefill[i:i + MAX_TOKENS_PER_CALL]
              for i in range(0, len(prefill), MAX_TOKENS_PER_CALL)]
    for layer in range(trace.n_layers):
        for piece in pieces:
            for expert in _distinct(trace.expert_ids[piece, layer]):
                yield False, (layer, expert)
    for t in range(start, end):
        if phase[t] == DECODE:
            for layer in range(trace.n_layers):
                for expert in _distinct(trace.expert_ids[[t], layer]):
                    yield True, (layer, expert)


def _distinct(ids: np.ndarray) -> list[int]:
    """ids [tokens, k] -> the experts picked, ascending (unrecorded slots dropped)."""
    return sorted({int(e) for e in ids.reshape(-1) if e >= 0})


def lru_hit_rate(trace: RoutingTrace, slots: int) -> tuple[float, int]:
    """(hit rate of the decode steps' requests, their number) with ``slots`` expert slots,
    every prompt from an empty cache."""
    hits = requests = 0
    for prompt in range(trace.n_prompts):
        cache = LRU(slots)  # the store's own policy class
        for decode, key in store_requests(trace, prompt):
            hit = cache.access(key).hit
            if decode:
                requests += 1
                hits += hit
    return (hits / requests if requests else 0.0), requests
