"""Statistics of a routing trace: how concentrated, how repetitive and how predictable routing is.

Legend for shape comments: T tokens, L traced layers, k experts per token, E experts per layer.
Every statistic skips (token, layer) pairs the trace did not record, and consecutive-token
statistics never pair the last token of one prompt with the first of the next.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from moeswap.routing.traces import RoutingTrace


def popularity(trace: RoutingTrace) -> np.ndarray:
    """[L, E] int: how many tokens chose each expert at each layer (any of the k)."""
    counts = np.zeros((trace.n_layers, trace.n_experts), dtype=np.int64)
    for layer in range(trace.n_layers):
        ids = trace.expert_ids[:, layer]  # [T, k]
        counts[layer] = np.bincount(ids[ids >= 0], minlength=trace.n_experts)
    return counts


def gini(counts: np.ndarray) -> np.ndarray:
    """[...] Gini coefficient over the last axis: 0 when every expert is used equally, (E-1)/E when one takes all."""
    x = np.sort(counts.astype(np.float64), axis=-1)
    n = x.shape[-1]
    total = x.sum(axis=-1)
    ranks = np.arange(1, n + 1)
    weighted = (x * ranks).sum(axis=-1)
    return np.where(total > 0, (2 * weighted) / (n * np.maximum(total, 1e-300)) - (n + 1) / n, 0.0)


def entropy_bits(counts: np.ndarray) -> np.ndarray:
    """[...] Shannon entropy of the share of routes over the last axis, in bits (log2 E at most)."""
    p = counts / np.maximum(counts.sum(axis=-1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log2(p), 0.0)
    return terms.sum(axis=-1)


def top_share(counts: np.ndarray, fraction: float = 0.1) -> np.ndarray:
    """[...] Share of routes taken by the most used ceil(fraction x E) experts."""
    n_top = max(1, math.ceil(fraction * counts.shape[-1]))
    top = -np.sort(-counts, axis=-1)[..., :n_top]
    return top.sum(axis=-1) / np.maximum(counts.sum(axis=-1), 1)


def consecutive_pairs(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """Indices (t, l) of pairs where tokens t and t+1 of one prompt are both recorded at layer l."""
    same_prompt = np.diff(trace.prompt_of_token()) == 0  # [T-1]
    both = trace.valid[:-1] & trace.valid[1:] & same_prompt[:, None]  # [T-1, L]
    return np.nonzero(both)


def consecutive_reuse(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the Mixtral paper's Table 5 shares over consecutive tokens (t, t+1):

    first: both chose the same first expert; any: their k chosen experts overlap.
    """
    t, layer = consecutive_pairs(trace)
    now, nxt = trace.expert_ids[t, layer], trace.expert_ids[t + 1, layer]  # [pairs, k]
    first_same = now[:, 0] == nxt[:, 0]
    overlap = (now[:, :, None] == nxt[:, None, :]).any(axis=(1, 2))  # [pairs]
    pairs = np.bincount(layer, minlength=trace.n_layers)
    first = np.bincount(layer, weights=first_same, minlength=trace.n_layers) / np.maximum(pairs, 1)
    any_ = np.bincount(layer, weights=overlap, minlength=trace.n_layers) / np.maximum(pairs, 1)
    return first, any_


def random_reuse(n_experts: int, k: int) -> tuple[float, float]:
    """The same two shares if every token chose k distinct experts uniformly at random."""
    return 1 / n_experts, 1 - math.comb(n_experts - k, k) / math.comb(n_experts, k)


def reuse_distances(trace: RoutingTrace) -> np.ndarray:
    """[D] counts: d tokens since the same layer last chose the expert (index d; 0 unused).

    Counted over each layer's recorded tokens in trace order (a cache lives across prompts);
    first uses have no distance and are not counted.
    """
    distances: list[int] = []
    for layer in range(trace.n_layers):
        ids = trace.expert_ids[trace.valid[:, layer], layer]  # [T_l, k]
        last_seen = np.full(trace.n_experts, -1)
        for position, chosen in enumerate(ids):
            seen = last_seen[chosen] >= 0
            distances.extend((position - last_seen[chosen][seen]).tolist())
            last_seen[chosen] = position
    return np.bincount(np.asarray(distances, dtype=np.int64), minlength=2)


def coactivation(trace: RoutingTrace) -> np.ndarray:
    """[L-1, E, E] counts: a token chose expert i at layer l and expert j at layer l+1."""
    L, E = trace.n_layers, trace.n_experts
    counts = np.zeros((max(L - 1, 0), E, E), dtype=np.int64)
    for layer in range(L - 1):
        rows = trace.valid[:, layer] & trace.valid[:, layer + 1]
        here, there = trace.expert_ids[rows, layer], trace.expert_ids[rows, layer + 1]  # [n, k]
        for a in range(trace.k):
            for b in range(trace.k):
                np.add.at(counts[layer], (here[:, a], there[:, b]), 1)
    return counts


def next_layer_predictability(trace: RoutingTrace, co: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer pair (l, l+1), the share of layer l+1's experts guessed right from a k-expert guess.

    conditional: guess the k experts most co-activated with the token's layer-l experts;
    popular: guess layer l+1's k most used experts. Both are fitted on this same trace, so
    they are in-sample upper estimates; their difference is what layer l tells about l+1.
    """
    L, k = trace.n_layers, trace.k
    conditional, popular = np.zeros(max(L - 1, 0)), np.zeros(max(L - 1, 0))
    for layer in range(L - 1):
        rows = trace.valid[:, layer] & trace.valid[:, layer + 1]
        here, there = trace.expert_ids[rows, layer], trace.expert_ids[rows, layer + 1]  # [n, k]
        if not len(here):
            continue
        scores = co[layer][here].sum(axis=1)  # [n, E]
        guess = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # [n, k]
        conditional[layer] = (guess[:, :, None] == there[:, None, :]).any(axis=2).mean()
        top = np.argsort(-counts[layer + 1], kind="stable")[:k]  # [k]
        popular[layer] = np.isin(there, top).mean()
    return conditional, popular


def mutual_information_bits(co: np.ndarray) -> np.ndarray:
    """[L-1] bits that a token's expert at layer l tells about its expert at l+1, from co-activation counts.

    In-sample, so biased upwards by about (E-1)^2 / (2 N ln 2) bits for N counted pairs.
    """
    joint = co / np.maximum(co.sum(axis=(1, 2), keepdims=True), 1)  # [L-1, E, E]
    here, there = joint.sum(axis=2, keepdims=True), joint.sum(axis=1, keepdims=True)  # [L-1, E, 1], [L-1, 1, E]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(joint > 0, joint * np.log2(joint / (here * there)), 0.0)
    return terms.sum(axis=(1, 2))


@dataclass
class TraceStats:
    model: str
    n_tokens: int
    n_prompts: int
    layers: list[int]
    n_experts: int
    k: int
    counts: list[list[int]]  # [L][E]
    gini: list[float]
    entropy_bits: list[float]
    top10_share: list[float]
    reuse_first: list[float]
    reuse_any: list[float]
    random_reuse_first: float
    random_reuse_any: float
    reuse_distance_counts: list[int]  # index = distance in tokens
    next_layer_conditional: list[float]  # [L-1]
    next_layer_popular: list[float]  # [L-1]
    next_layer_mutual_info_bits: list[float]  # [L-1]

    def to_dict(self) -> dict:
        return asdict(self)


def trace_stats(trace: RoutingTrace) -> TraceStats:
    counts = popularity(trace)
    first, any_ = consecutive_reuse(trace)
    rand_first, rand_any = random_reuse(trace.n_experts, trace.k)
    co = coactivation(trace)
    conditional, popular = next_layer_predictability(trace, co, counts)
    return TraceStats(
        model=trace.model,
        n_tokens=trace.n_tokens,
        n_prompts=trace.n_prompts,
        layers=trace.layers.tolist(),
        n_experts=trace.n_experts,
        k=trace.k,
        counts=counts.tolist(),
        gini=gini(counts).tolist(),
        entropy_bits=entropy_bits(counts).tolist(),
        top10_share=top_share(counts).tolist(),
        reuse_first=first.tolist(),
        reuse_any=any_.tolist(),
        random_reuse_first=rand_first,
        random_reuse_any=rand_any,
        reuse_distance_counts=reuse_distances(trace).tolist(),
        next_layer_conditional=conditional.tolist(),
        next_layer_popular=popular.tolist(),
        next_layer_mutual_info_bits=mutual_information_bits(co).tolist(),
    )


def render_stats(stats: TraceStats, console) -> None:
    """Per-layer table of the statistics, then one line per whole-trace figure."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"{stats.model}: {stats.n_tokens} tokens, {stats.n_prompts} prompts, "
                        f"{stats.n_experts} experts, top-{stats.k}", box=box.SIMPLE_HEAD,
                  collapse_padding=True)
    # short header words and no column rules: the table fits an 80-column terminal uncut
    for column in ("block", "gini", "entropy\n(bits)", "top-10%\nshare", "reuse\n1st",
                   f"reuse\nany-of-{stats.k}", "next\nguess", "popular\nguess", "next MI\n(bits)"):
        table.add_column(column, justify="right", min_width=max(map(len, column.split("\n"))))
    L = len(stats.layers)
    for i in range(L):
        has_next = i < L - 1
        table.add_row(
            str(stats.layers[i]), f"{stats.gini[i]:.3f}", f"{stats.entropy_bits[i]:.3f}",
            f"{stats.top10_share[i]:.1%}", f"{stats.reuse_first[i]:.1%}", f"{stats.reuse_any[i]:.1%}",
            f"{stats.next_layer_conditional[i]:.1%}" if has_next else "",
            f"{stats.next_layer_popular[i]:.1%}" if has_next else "",
            f"{stats.next_layer_mutual_info_bits[i]:.3f}" if has_next else "",
        )
    console.print(table)
    console.print(f"random routing would give: reuse 1st {stats.random_reuse_first:.1%}, "
                  f"any-of-{stats.k} {stats.random_reuse_any:.1%}, entropy {math.log2(stats.n_experts):.3f} bits")
    distances = np.asarray(stats.reuse_distance_counts)
    if distances.sum():
        median = int(np.searchsorted(np.cumsum(distances), distances.sum() / 2))
        console.print(f"reuse distance: median {median} tokens, {distances[1] / distances.sum():.1%} at distance 1")
    console.print("next guess: the share of layer l+1's experts guessed from layer l's, fitted on this "
                  "trace (in-sample); popular guess: guessing l+1's most used experts; next MI: the "
                  "mutual information of the experts at l and l+1")
