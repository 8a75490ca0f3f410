"""The ``decay`` policy: decayed use counts, a popularity prior and TinyLFU-style admission.

Each expert carries a score: its past uses, each worth 2^(-age / half_life) (age in tokens of
its layer), plus a prior, ``prior_weight`` x its share of the layer's routes in a profiled
trace x E (1 for an expert of average popularity). On a miss with every slot taken, the
resident with the lowest score is the candidate victim (ties: least recently used), and the
miss is admitted only if its own score (this use included) is at least the victim's; else it
bypasses the cache, as an expert seldom used should not push out one often used (TinyLFU,
Einziger et al. 2017). Scores are kept for every expert seen, resident or not.

Decayed uses only change by a common factor as time passes, so each is stored as log2(uses) plus
now / half_life and decayed only when compared: a request costs O(1), a miss with full slots
one vectorised pass over the residents.

``fit_decay`` chooses the half-life and the prior's weight on a trace: the prior is learned
on one half and replayed on the other, so the choice is made out of sample.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moeswap.routing.policies import BYPASS, HIT, Access, CachePolicy, Key
from moeswap.routing.simulate import simulate
from moeswap.routing.stats import popularity
from moeswap.routing.traces import RoutingTrace

HALF_LIVES = (4.0, 16.0, 64.0, 256.0)  # tokens; fit_decay picks one
PRIOR_WEIGHTS = (0.0, 0.5, 2.0)  # uses credited at average popularity; fit_decay picks one
FIT_REQUESTS = 24_576  # requests of the scored half that a fit replays per candidate and capacity


@dataclass(frozen=True)
class DecayFit:
    """What ``fit_decay`` learned, kept in a profile (defaults: an untrained ``decay``)."""

    half_life: float = 16.0  # tokens
    prior_weight: float = 0.0

    def __post_init__(self) -> None:
        if not (self.half_life > 0 and self.prior_weight >= 0):
            raise ValueError(f"decay needs half_life > 0 and prior_weight >= 0, got {self}")


def popularity_prior(counts, weight: float) -> np.ndarray:
    """[L, E] the prior credit of each expert: ``weight`` x its share of its layer's routes x E."""
    counts = np.asarray(counts, dtype=np.float64)  # [L, E]
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    return weight * shares * counts.shape[1]


class DecayAdmit(CachePolicy):
    """Evicts the resident with the lowest decayed score; a miss scoring below that victim bypasses.

    ``k``: requests per token and layer (the clock counts tokens of each key's layer, as
    ``LearnedReuse``'s; a global cache's layers advance together, a token at a time, so their
    clocks share a scale); ``prior_of(key)``: the key's prior credit (``popularity_prior``);
    ``layer_of(key)``: the key's layer (one for a per-layer cache). The residents' scores sit
    in arrays, one entry per slot, so that a victim costs one vectorised pass, not a Python
    call per resident (the store may hold hundreds).
    """

    name = "decay"

    def __init__(self, capacity: int, k: int, half_life: float,
                 prior_of: Callable[[Key], float] = lambda key: 0.0,
                 layer_of: Callable[[Key], int] = lambda key: 0):
        super().__init__(capacity)
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.k, self.rate, self.prior_of, self.layer_of = k, 1.0 / half_life, prior_of, layer_of
        self._log_score: dict = {}  # key -> log2(decayed uses) + (token of last use) / half_life
        self._layer_index: dict = {}  # layer -> its entry in _requests and _now
        self._requests: list[int] = []  # per layer
        self._now = np.zeros(0)  # [layers] the current token / half_life, per layer
        self._slot: dict = {}  # resident key -> its slot
        self._keys: list = []  # [slots] the key in each slot
        self._base = np.zeros(capacity)  # [slots] _log_score of each slot's key
        self._prior = np.zeros(capacity)  # [slots] its prior credit
        self._layer = np.zeros(capacity, dtype=np.int64)  # [slots] its layer's entry
        self._last = np.zeros(capacity, dtype=np.int64)  # [slots] request count at its last use
        self._clock = 0

    def resident(self) -> set:
        return set(self._slot)

    def __contains__(self, key):
        return key in self._slot

    def __len__(self):
        return len(self._slot)

    def _tick(self, key: Key) -> int:
        """Count the request on its layer's clock -> that layer's entry."""
        layer = self.layer_of(key)
        index = self._layer_index.get(layer)
        if index is None:
            index = self._layer_index[layer] = len(self._requests)
            self._requests.append(0)
            self._now = np.append(self._now, 0.0)
        self._requests[index] += 1
        self._now[index] = (self._requests[index] - 1) // self.k * self.rate
        return index

    def _place(self, slot: int, key: Key, layer: int) -> None:
        self._slot[key] = slot
        self._base[slot], self._prior[slot] = self._log_score[key], self.prior_of(key)
        self._layer[slot], self._last[slot] = layer, self._clock

    def access(self, key):
        layer = self._tick(key)
        self._clock += 1
        now_scaled = self._now[layer]
        log_score = self._log_score.get(key)
        uses = 1.0 + (0.0 if log_score is None else 2.0 ** (log_score - now_scaled))
        self._log_score[key] = math.log2(uses) + now_scaled
        slot = self._slot.get(key)
        if slot is not None:
            self._base[slot], self._last[slot] = self._log_score[key], self._clock
            return HIT
        if self.capacity == 0:
            return BYPASS
        if len(self._keys) < self.capacity:
            self._keys.append(key)
            self._place(len(self._keys) - 1, key, layer)
            return Access(hit=False, admitted=True)
        scores = np.exp2(self._base - self._now[self._layer]) + self._prior  # [slots]
        lowest = np.flatnonzero(scores == scores.min())
        slot = int(lowest[np.argmin(self._last[lowest])])  # ties: the least recently used
        if uses + self.prior_of(key) < scores[slot]:
            return BYPASS
        victim = self._keys[slot]
        del self._slot[victim]
        self._keys[slot] = key
        self._place(slot, key, layer)
        return Access(hit=False, admitted=True, evicted=victim)


def decay_factory(fit: DecayFit, counts):
    """A ``simulate`` factory of ``decay`` with ``fit``'s half-life and a prior from ``counts``
    [L][E] (routes per expert, traced layers in order; None: no prior)."""
    prior = None if counts is None or not fit.prior_weight else popularity_prior(counts, fit.prior_weight)

    def factory(ctx):
        if prior is None:
            prior_of = _no_prior
        elif ctx.layer is None:  # global cache: keys are (traced layer, expert)
            prior_of = lambda key: prior[key[0], key[1]]
        else:
            prior_of = prior[ctx.layer].__getitem__
        return DecayAdmit(ctx.capacity, ctx.k, fit.half_life, prior_of, ctx.layer_of)

    return factory


def _no_prior(key: Key) -> float:
    return 0.0


def head(trace: RoutingTrace, n_tokens: int) -> RoutingTrace:
    """The trace's first ``n_tokens`` tokens (all of it when shorter), as one prompt."""
    if n_tokens >= trace.n_tokens:
        return trace
    cut = dataclasses.replace(trace, prompt_offsets=[0, n_tokens, trace.n_tokens],
                              prompt_names=["head", "rest"])
    return cut.select_prompts([0])


def fit_decay(learn: RoutingTrace, score: RoutingTrace, capacities: list[int]) -> DecayFit:
    """The half-life and prior weight (from HALF_LIVES x PRIOR_WEIGHTS) whose ``decay`` gets
    the most hits on ``score`` (its first FIT_REQUESTS requests) through per-layer caches of
    ``capacities``, the prior counted on ``learn``; ties go to the earlier candidate."""
    if not capacities or score.n_tokens == 0:
        return DecayFit()
    counts = popularity(learn)
    scored = head(score, max(1, FIT_REQUESTS // (score.n_layers * score.k)))
    candidates = [DecayFit(h, w) for h in HALF_LIVES for w in PRIOR_WEIGHTS]

    def hits(fit: DecayFit) -> int:
        factory = decay_factory(fit, counts)
        return sum(int(simulate(scored, "decay", factory, c, "per-layer").hits.sum()) for c in capacities)

    return max(candidates, key=hits)
