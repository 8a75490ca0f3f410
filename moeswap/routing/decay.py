"""The ``decay`` policy: decayed use counts, a popularity prior and TinyLFU-style admission.

Each expert carries a score: its past uses, each worth 2^(-age / half_life) (age in tokens of
its layer), plus a prior, ``prior_weight`` x its share of the layer's routes in a profiled
trace x E (1 for an expert of average popularity). On a miss with every slot taken, the
resident with the lowest score is the candidate victim (ties: least recently used), and the
miss is admitted only if its own score (this use included) is at least the victim's; else it
bypasses the cache, as an expert seldom used should not push out one often used (TinyLFU,
Einziger et al. 2017). Scores are kept for every expert seen, resident or not.

Scores only change by a common factor as time passes, so each is stored as log2(score) plus
now / half_life and compared without decaying anything: a request costs O(1), a miss with
full slots one pass over the residents (as LRU's victim search here).

``fit_decay`` chooses the half-life and the prior's weight on a trace: the prior is learned
on one half and replayed on the other, so the choice is made out of sample.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moeswap.routing.policies import BYPASS, HIT, Access, CachePolicy, Key
from moeswap.routing.simulate import simulate
from moeswap.routing.stats import popularity
from moeswap.routing.traces import RoutingTrace

HALF_LIVES = (4.0, 16.0, 64.0)  # tokens; fit_decay picks one
PRIOR_WEIGHTS = (0.0, 0.5)  # uses credited at average popularity; fit_decay picks one
FIT_REQUESTS = 24_576  # requests of the scored half that a fit replays per candidate and capacity


@dataclass(frozen=True)
class DecayFit:
    """What ``fit_decay`` learned, kept in a profile (defaults: an untrained ``decay``)."""

    half_life: float = 16.0  # tokens
    prior_weight: float = 0.0


def popularity_prior(counts, weight: float) -> np.ndarray:
    """[L, E] the prior credit of each expert: ``weight`` x its share of its layer's routes x E."""
    counts = np.asarray(counts, dtype=np.float64)  # [L, E]
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    return weight * shares * counts.shape[1]


class DecayAdmit(CachePolicy):
    """Evicts the resident with the lowest decayed score; a miss scoring below that victim bypasses.

    ``k``: requests per token and layer (the clock counts tokens of each key's layer, as
    ``LearnedReuse``'s); ``prior_of(key)``: the key's prior credit (``popularity_prior``);
    ``layer_of(key)``: the key's layer (one for a per-layer cache).
    """

    name = "decay"

    def __init__(self, capacity: int, k: int, half_life: float,
                 prior_of: Callable[[Key], float] = lambda key: 0.0,
                 layer_of: Callable[[Key], int] = lambda key: 0):
        super().__init__(capacity)
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.k, self.rate, self.prior_of, self.layer_of = k, 1.0 / half_life, prior_of, layer_of
        self._requests: Counter = Counter()  # per layer
        self._log_score: dict = {}  # key -> log2(decayed uses) + (token of last use) / half_life
        self._last_use: dict = {}  # resident key -> request count when last used, for ties
        self._clock = 0

    def resident(self) -> set:
        return set(self._last_use)

    def __contains__(self, key):
        return key in self._last_use

    def __len__(self):
        return len(self._last_use)

    def _score(self, key: Key, now_scaled: float) -> float:
        log_score = self._log_score.get(key)
        uses = 0.0 if log_score is None else 2.0 ** (log_score - now_scaled)
        return uses + self.prior_of(key)

    def access(self, key):
        layer = self.layer_of(key)
        self._requests[layer] += 1
        self._clock += 1
        now_scaled = (self._requests[layer] - 1) // self.k * self.rate
        log_score = self._log_score.get(key)
        uses = 1.0 + (0.0 if log_score is None else 2.0 ** (log_score - now_scaled))
        self._log_score[key] = math.log2(uses) + now_scaled
        if key in self._last_use:
            self._last_use[key] = self._clock
            return HIT
        if self.capacity == 0:
            return BYPASS
        if len(self._last_use) < self.capacity:
            self._last_use[key] = self._clock
            return Access(hit=False, admitted=True)
        # every key of a per-layer cache shares one clock; a global cache's layers advance
        # together, a token at a time, so one clock per candidate's own layer is the same scale
        victim = min(self._last_use, key=lambda r: (
            self._score(r, (self._requests[self.layer_of(r)] - 1) // self.k * self.rate),
            self._last_use[r]))
        victim_now = (self._requests[self.layer_of(victim)] - 1) // self.k * self.rate
        if self._score(key, now_scaled) < self._score(victim, victim_now):
            return BYPASS
        del self._last_use[victim]
        self._last_use[key] = self._clock
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
