"""Prefetch: guess the next MoE layers' experts and read them from disk while this layer computes.

Predictors (``--prefetch``), each giving per token a score over the experts of a later layer:

- ``gate``: speculative gating, layer L+d's router applied to layer L's hidden state (the
  input of L's experts); the score is its softmax. The store is handed the routers at build time.
- ``history``: co-activation counts between consecutive MoE layers, learned online from the
  routing the store sees (``counts[L][e, f]``: tokens that picked e at L and f at the next
  layer); the score at depth d chains the row-normalised counts d times from L's picks.
- ``both``: the mean of the two scores.

Guesses are each token's top-k experts by score (their union, at most ``2 * top_k`` per target
layer, best first). Every guess is checked when its target layer runs (recall and precision per
layer and depth), whether or not it was read: this "shadow" measurement is what the adaptive
rule uses. Reads are issued only

- for (layer, depth) pairs whose recent precision is at least ``MIN_PRECISION`` (a pair's
  first guesses are checked unread: a predictor with nothing to go on never reads);
- for target layers where the recent share of reads that were used before being evicted is at
  least ``MIN_PRECISION`` (a budget too small to keep a guess until its layer runs turns
  prefetch off there; one round in ``PROBE_EVERY`` still reads, to notice when that changes);
- while fewer than ``queue_bound`` reads wait (a busy link takes no more guesses), and while
  this forward's reads fit the link's idle time (``IdleLink``: a link busy with the store's
  own reads takes only the guesses it has time for);
- into a host slot reserved for guesses (the host policy has that many fewer), free or holding
  a policy's victim or an older guess nobody used: a guess stays outside the host policy until
  a request uses it, so it never evicts a requested expert (moeswap.experts.guesses); with no
  such slot, nothing is predicted.

Reads run on the store's reader threads in the disk's idle time, behind every read a step asks
for, a chunk at a time (moeswap.experts.disk_reads): a guess fills the time between a layer's
last read and the next layer's routing, and a step's own read waits at most for one chunk.
The store decides residency on its own thread (moeswap.experts.store).

Above all of that, ``Throttle`` keeps prefetch from costing time: it times whole forwards with
prefetch off, then on (a probe of ``PROBE_FORWARDS`` each, off first, so a run shorter than that
never pays for prefetch), keeps it on only where on was at least ``MARGIN`` faster, and
otherwise turns it off completely (no prediction, no reads) for ``RECHECK_FORWARDS`` forwards,
doubling up to ``MAX_RECHECK`` while it keeps losing. The on arm is cut short, lost, after
``EARLY_FORWARDS`` forwards if their median is not under the off arm's; at its end it is lost
too if the store's thread spent longer on prefetch (predicting, handing reads over, waiting for
them) than the load time it hid. (Not after the first forwards: the first guesses of each layer
are only checked, not read, so a few forwards count the predictor's cost and little of what it
hides.)

Legend: N tokens, K picks per token, X experts of a layer.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from moeswap.experts.settings import PREDICTORS

MIN_PRECISION = 0.5  # below it a wrong read costs more link time and evictions than hits save
PRECISION_MEMORY = 0.1  # weight of the newest check in the running precision
PROBE_EVERY = 16  # rounds of a target layer turned off for uselessness between probing reads
PROBE_FORWARDS = 8  # timed forwards in each arm (on, off) of a throttle probe
EARLY_FORWARDS = 3  # on-forwards after which a probe that is not paying is lost
MARGIN = 0.03  # prefetch stays on only when its forwards' median is this much under off's
RECHECK_FORWARDS = 256  # forwards between probes; doubled after each probe prefetch loses
MAX_RECHECK = 4096


class TransitionCounts:
    """How often a token's pick e at one MoE layer was followed by f at the next."""

    def __init__(self, layers: list[int], n_experts: int):
        self.next = dict(zip(layers, layers[1:]))
        self.counts = {layer: torch.zeros(n_experts, n_experts) for layer in layers[:-1]}
        self._last: tuple[int, torch.Tensor] | None = None  # (layer, ids [N, K]) seen last

    def forget_last(self) -> None:
        """The next picks seen do not follow the last ones (layers were skipped)."""
        self._last = None

    def observe(self, layer: int, ids: torch.Tensor) -> None:
        if self._last is not None:
            before, before_ids = self._last
            if self.next.get(before) == layer and before_ids.shape[0] == ids.shape[0]:
                rows = before_ids[:, :, None].expand(-1, -1, ids.shape[1])  # [N, K, K]
                cols = ids[:, None, :].expand(-1, before_ids.shape[1], -1)  # [N, K, K]
                self.counts[before].index_put_((rows.reshape(-1), cols.reshape(-1)),
                                               torch.ones(rows.numel()), accumulate=True)
        self._last = (layer, ids)

    def scores(self, layer: int, ids: torch.Tensor, depth: int) -> torch.Tensor:
        """ids [N, K] at ``layer`` -> [N, X] expected picks ``depth`` MoE layers on."""
        n_experts = self.counts[layer].shape[0] if layer in self.counts else 0
        p = torch.zeros(ids.shape[0], n_experts)
        p.scatter_add_(1, ids, torch.full(ids.shape, 1.0 / ids.shape[1]))  # [N, X]
        for _ in range(depth):
            counts = self.counts[layer]
            p = p @ (counts / counts.sum(dim=1, keepdim=True).clamp(min=1.0))
            layer = self.next[layer]
        return p


@dataclass
class Accuracy:
    """Guesses for one target layer made ``depth`` layers ahead, checked when it ran."""
    guessed: int = 0
    actual: int = 0
    hits: int = 0
    precision_now: float | None = None  # running precision (PRECISION_MEMORY), from the
    # first check on: a pair reads nothing until one check has shown its guesses worth reading
    # (still checked while below MIN_PRECISION: it may come back)

    def check(self, guess: set[int], actual: set[int]) -> None:
        hits = len(guess & actual)
        self.guessed, self.actual, self.hits = (self.guessed + len(guess),
                                                self.actual + len(actual), self.hits + hits)
        if not guess:
            return
        if self.precision_now is None:
            self.precision_now = hits / len(guess)
        else:
            self.precision_now += PRECISION_MEMORY * (hits / len(guess) - self.precision_now)

    @property
    def enabled(self) -> bool:
        return self.precision_now is not None and self.precision_now >= MIN_PRECISION

    def as_dict(self) -> dict:
        return {"guessed": self.guessed, "actual": self.actual, "hits": self.hits,
                "recall": self.hits / self.actual if self.actual else 0.0,
                "precision": self.hits / self.guessed if self.guessed else 0.0}


@dataclass
class PrefetchCounts:
    reads: int = 0  # reads handed to the worker
    bytes_prefetched: int = 0  # bytes those reads brought in
    used: int = 0  # prefetched experts later asked for
    bytes_wasted: int = 0  # prefetched bytes evicted before anyone asked for them
    cancelled: int = 0  # stale reads dropped before they started
    wait_seconds: float = 0.0  # the store's thread waiting on a read already running
    cost_seconds: float = 0.0  # all the store's thread spent on prefetch: predicting, handing
    # reads over, waiting (what the throttle weighs against hidden_seconds)
    hidden_seconds: float = 0.0  # read time of used prefetches the store did not wait for
    uploads: int = 0  # guesses copied on to the device tier ahead of use (CUDA copy stream)


class Prefetcher:
    """Predicts, checks and throttles; the store moves the bytes (moeswap.experts.store)."""

    def __init__(self, mode: str, depth: int, layers: list[int], routers: dict, n_experts: int,
                 top_k: int):
        if mode not in PREDICTORS[1:]:
            raise ValueError(f"prefetch mode must be one of {PREDICTORS[1:]}, got {mode!r}")
        missing = [i for i in layers if i not in routers] if mode != "history" else []
        if missing:
            raise ValueError(f"the gate predictor needs every MoE layer's router; "
                             f"{missing} lack one")
        self.mode, self.depth, self.layers, self.routers = mode, depth, layers, routers
        self.top_k, self.cap = top_k, 2 * top_k
        self.queue_bound = depth * self.cap
        self.history = TransitionCounts(layers, n_experts)
        self.accuracy = {t: {d: Accuracy() for d in range(1, depth + 1)} for t in layers}
        self.counts = PrefetchCounts()
        self._pending: dict[int, dict[int, set[int]]] = {}  # target layer -> depth -> guess
        self.useful_now = {t: 1.0 for t in layers}  # running share of reads used, per target
        self._rounds_off = {t: 0 for t in layers}
        self.throttle = Throttle()
        self.link = IdleLink()

    def pause(self) -> None:
        """The throttle turned prefetch off: guesses made so far will not be checked."""
        self._pending.clear()
        self.history.forget_last()

    def spent(self, seconds: float) -> None:
        """The store's thread spent this long on prefetch."""
        self.counts.cost_seconds += seconds
        self.throttle.cost += seconds

    def hid(self, seconds: float) -> None:
        """A used guess's read saved the store's thread this long."""
        self.counts.hidden_seconds += seconds
        self.throttle.hidden += seconds

    def uploaded(self) -> None:
        """A guess was copied on to the device tier ahead of use."""
        self.counts.uploads += 1

    def read_outcome(self, target: int, used: bool) -> None:
        """A read for ``target`` was used, or evicted unused."""
        self.useful_now[target] += PRECISION_MEMORY * (float(used) - self.useful_now[target])

    def _reads_wanted(self, target: int, depth: int) -> bool:
        if not self.accuracy[target][depth].enabled:
            return False
        if self.useful_now[target] >= MIN_PRECISION:
            return True
        self._rounds_off[target] += 1
        return self._rounds_off[target] % PROBE_EVERY == 0

    def observe(self, layer: int, ids: torch.Tensor) -> None:
        """Check the guesses made for this layer against its picks ids [N, K]; learn from them."""
        actual = set(ids.flatten().tolist())
        for depth, guess in self._pending.pop(layer, {}).items():
            self.accuracy[layer][depth].check(guess, actual)
        if self.mode != "gate":
            self.history.observe(layer, ids)

    def guesses(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> list[tuple[int, int]]:
        """Keys (target layer, expert) worth reading now, nearest layer first, best first."""
        keys = [(target, e) for depth, target, chosen in self.predict(layer, x, ids)
                if self._reads_wanted(target, depth) for e in chosen]
        return keys[:self.queue_bound]

    def predict(self, layer: int, x: torch.Tensor,
                ids: torch.Tensor) -> list[tuple[int, int, list[int]]]:
        """(depth, target layer, experts best first) for each layer ahead; every guess is
        remembered for checking when its target runs, read or not."""
        at, predicted = self.layers.index(layer), []
        for depth, target in enumerate(self.layers[at + 1:at + 1 + self.depth], start=1):
            scores = self._scores(layer, target, x, ids, depth)  # [N, X]
            top = torch.topk(scores, self.top_k, dim=-1)
            best: dict[int, float] = {}
            for expert, score in zip(top.indices.flatten().tolist(), top.values.flatten().tolist()):
                best[expert] = max(score, best.get(expert, 0.0))
            chosen = sorted((e for e in best if best[e] > 0), key=lambda e: -best[e])[:self.cap]
            self._pending.setdefault(target, {})[depth] = set(chosen)
            predicted.append((depth, target, chosen))
        return predicted

    def _scores(self, layer: int, target: int, x: torch.Tensor, ids: torch.Tensor,
                depth: int) -> torch.Tensor:
        if self.mode == "history":
            return self.history.scores(layer, ids, depth)
        gate = torch.softmax(self.routers[target].logits(x), dim=-1)  # [N, X]
        if self.mode == "gate":
            return gate
        return (gate + self.history.scores(layer, ids, depth)) / 2

    def as_dict(self) -> dict:
        c = self.counts
        return {"mode": self.mode, "depth": self.depth, "reads": c.reads,
                "bytes_prefetched": c.bytes_prefetched, "used": c.used,
                "bytes_wasted": c.bytes_wasted, "cancelled": c.cancelled,
                "wait_seconds": c.wait_seconds, "hidden_seconds": c.hidden_seconds,
                "cost_seconds": c.cost_seconds,
                "uploads": c.uploads, "adaptive": self.throttle.as_dict(),
                "link_budget_bytes": self.link.per_forward,
                "layers": {t: {d: {**a.as_dict(), "reads_enabled": a.enabled and
                                   self.useful_now[t] >= MIN_PRECISION}
                               for d, a in by_depth.items()}
                           for t, by_depth in self.accuracy.items()}}


class IdleLink:
    """How many bytes of guesses a forward may read: the link's idle time in recent forwards
    run without prefetch (a forward's time less the store's stall in it), times the rate of
    the store's own reads. A link that is busy anyway (stalls fill the forward) then takes
    only the guesses it has time for, not a read that would delay a request's. Unlimited until
    a forward without prefetch was timed and a read measured. The last read may overshoot."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._idle: deque[float] = deque(maxlen=PROBE_FORWARDS)  # seconds, off forwards
        self._last: tuple[float, float, int, bool] | None = None  # (start, stall so far,
        # tokens, prefetch on) of the current forward
        self.per_forward: float | None = None  # bytes a forward may read; None: unlimited
        self._left = math.inf  # what the current forward may still read

    def forward(self, n_tokens: int, stall_seconds: float, read_bytes: int,
                read_seconds: float, on: bool) -> None:
        """A forward of ``n_tokens`` starts; the store has stalled ``stall_seconds`` and read
        ``read_bytes`` in ``read_seconds`` so far; ``on``: prefetch runs in this forward."""
        now = self.clock()
        if self._last is not None:
            start, stall, tokens, was_on = self._last
            if not was_on and tokens == n_tokens:  # a comparable forward without prefetch
                self._idle.append(max(0.0, now - start - (stall_seconds - stall)))
        self._last = (now, stall_seconds, n_tokens, on)
        if self._idle and read_seconds > 0:
            self.per_forward = statistics.median(self._idle) * read_bytes / read_seconds
        self._left = math.inf if self.per_forward is None else self.per_forward

    def allows(self) -> bool:
        return self._left > 0

    def spend(self, n_bytes: int) -> None:
        self._left -= n_bytes


class Throttle:
    """Whether prefetch runs in the next forward, from the measured time of forwards with it on
    and off. A probe runs ``PROBE_FORWARDS`` forwards off, then as many on; prefetch stays on
    until the next probe only if the median on-forward was ``MARGIN`` faster than the median
    off-forward. A forward's time is from its first MoE layer to the next forward's; forwards
    whose token count differs from the next one's (a prefill, a batch changing) are not timed.
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.on = False  # prefetch runs in the current forward; a probe starts off
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._probing = True
        self._hold = 0  # forwards left before the next probe
        self._pause = RECHECK_FORWARDS  # how long a lost probe turns prefetch off
        self._last: tuple[float, int] | None = None  # (start, tokens) of the current forward
        self.probes = self.probes_won = self.forwards_on = self.forwards_off = 0
        self.medians: tuple[float, float] | None = None  # (on, off) seconds, last probe
        self.cost = self.hidden = 0.0  # this probe: seconds prefetch took from / saved the store

    def forward(self, n_tokens: int) -> bool:
        """A forward of ``n_tokens`` starts -> whether prefetch runs in it."""
        now = self.clock()
        if self._probing and self._last is not None and self._last[1] == n_tokens:
            self._times[self.on].append(now - self._last[0])
        self._last = (now, n_tokens)
        if self._probing:
            self._probe_step()
        elif self._hold > 0:
            self._hold -= 1
        else:  # the next probe: off first
            self._probing, self.on = True, False
            self._times = {True: [], False: []}
            self.cost = self.hidden = 0.0
        if self.on:
            self.forwards_on += 1
        else:
            self.forwards_off += 1
        return self.on

    def _probe_step(self) -> None:
        if not self.on:
            if len(self._times[False]) >= PROBE_FORWARDS:
                self.on, self.cost, self.hidden = True, 0.0, 0.0  # the on arm
            return
        timed_on = len(self._times[True])
        if timed_on < EARLY_FORWARDS:
            return
        on, off = (statistics.median(self._times[arm]) for arm in (True, False))
        if on >= off:
            self._decide(False, (on, off))
        elif timed_on >= PROBE_FORWARDS:
            self._decide(on < off * (1 - MARGIN) and self.cost <= self.hidden, (on, off))

    def _decide(self, won: bool, medians: tuple[float, float]) -> None:
        self.medians, self.probes, self._probing, self.on = medians, self.probes + 1, False, won
        if won:
            self.probes_won += 1
            self._hold, self._pause = RECHECK_FORWARDS, RECHECK_FORWARDS
        else:
            self._hold, self._pause = self._pause, min(2 * self._pause, MAX_RECHECK)

    def as_dict(self) -> dict:
        on, off = self.medians or (0.0, 0.0)
        return {"on_now": self.on, "probes": self.probes, "probes_won": self.probes_won,
                "forwards_on": self.forwards_on, "forwards_off": self.forwards_off,
                "probe_on_seconds": on, "probe_off_seconds": off}
