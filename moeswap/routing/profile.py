"""Routing profiles: what a trace teaches a cache — the hot set per layer and a reuse table.

A profile (``profile.json``) holds the experts to pin, chosen by how often the trace used
them within an expert budget, and the ``ReuseTable`` the ``learned`` policy evicts by.
Both are learned from one trace and meant to be used on other runs.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeswap.errors import MoeswapError, write_or_raise
from moeswap.routing.decay import DecayFit, fit_decay
from moeswap.routing.policies import LearnedReuse, ReuseTable
from moeswap.routing.simulate import simulate
from moeswap.routing.stats import popularity
from moeswap.routing.traces import RoutingTrace

PROFILE_FORMAT = "moeswap.profile.v1"
AGE_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 1 << 30)  # tokens; the last bucket is open
WINDOW_CHOICES = (8, 16, 32, 64, 128)  # tokens; build_profile picks one by cross-validation
SCORED_CAPACITIES = 6  # at most this many per-layer capacities score each window
REUSE_WINDOW = 16  # tokens; the window of traces too short to cross-validate
REUSE_HORIZON = 64  # tokens; later (or never) next uses count as this
MIN_SAMPLES = 5  # a pooled cell with fewer samples falls back to its age bucket's mean


@dataclass
class Profile:
    model: str
    arch: str
    layers: list[int]  # model block index of each traced layer
    n_experts: int
    k: int
    budget: int  # experts pinned in total
    hot: list[tuple[int, int]]  # (traced layer, expert), most used first
    counts: list[list[int]]  # [L][E] routes per expert in the source trace
    reuse: ReuseTable
    source: str
    decay: DecayFit = field(default_factory=DecayFit)  # the ``decay`` policy's half-life and prior weight
    path: str = field(default="", compare=False)  # the file it was loaded from, for errors

    def check_fits(self, layers: list[int], n_experts: int, what: str) -> None:
        """Refuse a profile of another model: ``layers`` (model block index of each MoE or traced
        layer, in order) and ``n_experts`` are those of ``what`` (a model or trace file)."""
        name = self.path or "the profile"
        if self.layers != list(layers) or self.n_experts != n_experts:
            raise MoeswapError(f"{name}: profile is for layers {self.layers} with {self.n_experts} "
                               f"experts, {what} has {list(layers)} with {n_experts}; profile a "
                               "trace of this model over every MoE layer")
        outside = [pair for pair in self.hot
                   if not (0 <= pair[0] < len(self.layers) and 0 <= pair[1] < self.n_experts)]
        if outside:
            raise MoeswapError(f"{name}: damaged profile (hot expert {outside[0]} is outside its "
                               f"{len(self.layers)} layers of {self.n_experts} experts); make it "
                               "again with `moeswap profile`")

    def hot_in_layer(self, layer: int) -> list[int]:
        """The pinned experts of one traced layer, most used first."""
        return [expert for hot_layer, expert in self.hot if hot_layer == layer]

    def save(self, path: str | Path) -> None:
        doc = {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "arch": self.arch,
            "layers": self.layers,
            "n_experts": self.n_experts,
            "k": self.k,
            "budget": self.budget,
            "hot": {str(block): self.hot_in_layer(i) for i, block in enumerate(self.layers)},
            "hot_order": [list(pair) for pair in self.hot],
            "counts": self.counts,
            "reuse": {
                "age_edges": list(self.reuse.age_edges),
                "window": self.reuse.window,
                "expected_gap": [list(row) for row in self.reuse.expected_gap],
            },
            "decay": dataclasses.asdict(self.decay),
            "source": self.source,
        }
        with write_or_raise(path, "the profile"):
            Path(path).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise MoeswapError(f"{path}: no such profile; make one with `moeswap profile TRACE -o {path}`") from None
        except ValueError as e:
            raise MoeswapError(f"{path}: not JSON ({e}); make it with `moeswap profile`") from None
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise MoeswapError(f"{path}: not a {PROFILE_FORMAT} profile; make it with `moeswap profile`")
        try:
            reuse = doc["reuse"]
            return cls(
                model=doc["model"],
                arch=doc["arch"],
                layers=[int(x) for x in doc["layers"]],
                n_experts=int(doc["n_experts"]),
                k=int(doc["k"]),
                budget=int(doc["budget"]),
                hot=[(int(layer), int(expert)) for layer, expert in doc["hot_order"]],
                counts=doc["counts"],
                reuse=ReuseTable(tuple(reuse["age_edges"]), int(reuse["window"]),
                                 tuple(tuple(float(v) for v in row) for row in reuse["expected_gap"])),
                source=doc.get("source", ""),
                decay=DecayFit(**{name: float(v) for name, v in doc.get("decay", {}).items()}),
                path=str(path),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise MoeswapError(f"{path}: damaged profile (missing or bad {e}); "
                               "make it again with `moeswap profile`") from None


def hot_set(counts: np.ndarray, budget: int, per_layer: bool) -> list[tuple[int, int]]:
    """The (layer, expert) pairs to pin, most used first.

    per_layer: the ``budget`` most used experts of every layer. Otherwise ``budget`` in
    total, taken by route count across all layers (so skewed layers get more slots).
    Ties go to the lower layer, then the lower expert id.
    """
    L, E = counts.shape
    if budget < 0:
        raise MoeswapError(f"--budget must be >= 0, got {budget}")
    order = sorted((-int(counts[layer, e]), layer, e) for layer in range(L) for e in range(E))
    if not per_layer:
        return [(layer, e) for _, layer, e in order[:budget]]
    taken = Counter()
    chosen = []
    for _, layer, e in order:
        if taken[layer] < budget:
            taken[layer] += 1
            chosen.append((layer, e))
    return chosen


def use_bucket(uses: int) -> int:
    """Uses in the window, pooled: 0, 1, 2, 3-4, 5-8, 9-16, ... (bucket 0, 1, 2, 3, 4, 5, ...)."""
    return 0 if uses == 0 else (uses - 1).bit_length() + 1


def learn_reuse_table(trace: RoutingTrace, window: int = REUSE_WINDOW, horizon: int = REUSE_HORIZON) -> ReuseTable:
    """Mean tokens until the next use of an expert, by its age and its uses in the last ``window`` tokens.

    Sampled at every recorded token of every layer, for every expert that layer used before.
    Use counts are pooled in doubling buckets (``use_bucket``) so that each mean averages
    more samples: the cells an eviction compares (a busy expert idle for a while) are rare
    combinations. The table still has one column per count (pooled columns repeat), so the
    policy reads it unchanged.
    """
    sums = np.zeros((len(AGE_EDGES), window + 1))
    samples = np.zeros_like(sums)
    edges = np.asarray(AGE_EDGES)
    for layer in range(trace.n_layers):
        tokens = trace.expert_ids[trace.valid[:, layer], layer].tolist()  # [T_l][k]
        next_use = _next_use_after(tokens, trace.n_experts)
        last_use = np.full(trace.n_experts, -1)
        recent: deque = deque()
        uses = np.zeros(trace.n_experts, dtype=np.int64)
        for t, chosen in enumerate(tokens):
            seen = np.nonzero(last_use >= 0)[0]
            buckets = np.searchsorted(edges, t - last_use[seen])  # first edge >= age
            gaps = np.minimum(next_use[t][seen] - t, horizon)
            np.add.at(sums, (buckets, np.minimum(uses[seen], window)), gaps)
            np.add.at(samples, (buckets, np.minimum(uses[seen], window)), 1)
            last_use[chosen] = t
            recent.append(chosen)
            uses[chosen] += 1
            if len(recent) > window:
                uses[recent.popleft()] -= 1
    by_age = sums.sum(axis=1) / np.maximum(samples.sum(axis=1), 1)
    by_age[samples.sum(axis=1) == 0] = horizon
    pool = np.eye(use_bucket(window) + 1)[[use_bucket(f) for f in range(window + 1)]]  # [window+1, buckets]
    sums, samples = (sums @ pool) @ pool.T, (samples @ pool) @ pool.T  # each column: its bucket's total
    table = np.where(samples >= MIN_SAMPLES, sums / np.maximum(samples, 1), by_age[:, None])
    return ReuseTable(AGE_EDGES, window, tuple(tuple(round(float(v), 4) for v in row) for row in table))


def _next_use_after(tokens: list[list[int]], n_experts: int) -> np.ndarray:
    """[T, E] the first token >= t that uses each expert (a large number when none does)."""
    never = np.iinfo(np.int64).max // 2
    result = np.full((len(tokens) + 1, n_experts), never, dtype=np.int64)
    for t in range(len(tokens) - 1, -1, -1):
        result[t] = result[t + 1]
        result[t, tokens[t]] = t
    return result[:-1]


def halves(trace: RoutingTrace) -> tuple[RoutingTrace, RoutingTrace]:
    """The trace's first and second half: by prompts when it has several, else by tokens."""
    if trace.n_prompts >= 2:
        middle = trace.n_prompts // 2
        return (trace.select_prompts(list(range(middle))),
                trace.select_prompts(list(range(middle, trace.n_prompts))))
    cut = dataclasses.replace(trace, prompt_offsets=[0, trace.n_tokens // 2, trace.n_tokens],
                              prompt_names=["first half", "second half"])
    return cut.select_prompts([0]), cut.select_prompts([1])


def scored_capacities(k: int, n_experts: int) -> list[int]:
    """The per-layer capacities a window is scored at: k+1 .. E-1 (where policies differ), at
    most SCORED_CAPACITIES of them spread evenly, so that 256 experts cost what 8 do."""
    low, high = k + 1, n_experts - 1
    if high < low:
        return []
    n = min(SCORED_CAPACITIES, high - low + 1)
    return sorted({round(low + i * (high - low) / max(n - 1, 1)) for i in range(n)})


def choose_window(trace: RoutingTrace, on_window=None) -> int:
    """The reuse-table window that predicts this trace best, judged on this trace alone.

    Each candidate's table is learned on one half of the trace and replayed on the other,
    both ways, through per-layer caches of ``scored_capacities``; the window with the most
    hits wins, the smaller one on ties. ``on_window(window)`` is called as each is scored.
    """
    capacities = scored_capacities(trace.k, trace.n_experts)
    if trace.n_tokens < 4 or not capacities:
        return REUSE_WINDOW
    first, second = halves(trace)

    def hits(window: int) -> int:
        if on_window is not None:
            on_window(window)
        total = 0
        for learn_on, score_on in ((first, second), (second, first)):
            table = learn_reuse_table(learn_on, window)
            factory = lambda ctx: LearnedReuse(ctx.capacity, table, ctx.k, ctx.layer_of)  # noqa: E731
            total += sum(int(simulate(score_on, "learned", factory, c, "per-layer").hits.sum())
                         for c in capacities)
        return total

    return max(WINDOW_CHOICES, key=hits)


def build_profile(trace: RoutingTrace, budget: int, per_layer: bool, source: str = "",
                  window: int | None = None, on_window=None) -> Profile:
    """``window``: the reuse table's window as given (None: chosen by ``choose_window``)."""
    counts = popularity(trace)
    hot = hot_set(counts, budget, per_layer)
    return Profile(
        model=trace.model,
        arch=trace.arch,
        layers=trace.layers.tolist(),
        n_experts=trace.n_experts,
        k=trace.k,
        budget=len(hot),
        hot=hot,
        counts=counts.tolist(),
        reuse=learn_reuse_table(trace, window or choose_window(trace, on_window)),
        source=source or trace.source,
        decay=fit_decay(*halves(trace), scored_capacities(trace.k, trace.n_experts)[::2])
        if trace.n_tokens >= 4 else DecayFit(),
    )
