"""Prefetch: guess the next MoE layers' experts and read them from disk while this layer computes.

Predictors (``--prefetch``), each giving per token a score over the experts of a later layer:

- ``gate``: speculative gating, layer L+d's router applied to layer L's hidden state (the
  input of L's experts); the score is its logits. The store is handed the routers at build time.
- ``history``: co-activation counts between consecutive MoE layers, learned online from the
  routing the store sees (``counts[L][e, f]``: tokens that picked e at L and f at the next
  layer); the score at depth d chains the row-normalised counts d times from L's picks.
- ``both``: the mean of the two (the gate's as its softmax).

Guesses are each token's top-k experts by score (their union, at most ``2 * top_k`` per
target layer, best first); of a decode token's, only the likeliest is read (``DECODE_READS``).
Every guess is checked when its target layer runs (recall and precision per layer and depth),
whether or not it was read: this "shadow" measurement is what the adaptive rule uses. Reads are
issued only

- for (layer, depth) pairs whose recent precision is at least ``MIN_PRECISION`` (a pair's
  first guesses are checked unread: a predictor with nothing to go on never reads);
- for target layers where the recent share of reads that were used before being evicted is at
  least ``MIN_PRECISION`` (a budget too small to keep a guess until its layer runs turns
  prefetch off there; one round in ``PROBE_EVERY`` still reads, to notice when that changes);
- while fewer than ``queue_bound`` reads wait (a busy link takes no more guesses);
- into a host slot reserved for guesses (the host policy has that many fewer), free or holding
  a policy's victim or an older guess nobody used: a guess stays outside the host policy until
  a request uses it, so it never evicts a requested expert (moeswap.experts.guesses); with no
  such slot, nothing is predicted.

Reads run on the store's reader threads in the disk's idle time, behind every read a step asks
for, a chunk at a time (moeswap.experts.disk_reads): a guess fills the time between a layer's
last read and the next layer's routing, and a step's own read waits at most for one chunk.
The store decides residency on its own thread (moeswap.experts.store).

Above all of that, ``Throttle`` keeps prefetch from costing time. It judges prefetch by the
store's counts in windows of ``WINDOW_FORWARDS`` forwards, the first from the first forward:
the read time of used guesses that nobody waited for, against the time the store's thread spent
on prefetch (checking guesses, waiting for a draining slot, and predicting in steps that read
nothing) plus what the chunks of guesses that were not used had left to read when step reads
came. Where it hid less than that it is turned off completely (no prediction, no reads) for
``RECHECK_FORWARDS`` forwards, doubling up to ``MAX_RECHECK`` while it keeps losing. (A window
is long enough that the first guesses of each layer, which are only checked, not read, weigh
little.)

Legend: N tokens, K picks per token, X experts of a layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeswap.experts.settings import PREDICTORS

MIN_PRECISION = 0.5  # below it a wrong read costs more link time and evictions than hits save
PRECISION_MEMORY = 0.1  # weight of the newest check in the running precision
PROBE_EVERY = 16  # rounds of a target layer turned off for uselessness between probing reads
WINDOW_FORWARDS = 8  # forwards the throttle judges prefetch over
RECHECK_FORWARDS = 256  # forwards prefetch stays off after a lost window; doubled each loss
MAX_RECHECK = 4096
# Guesses read per layer ahead for a decode token: its likeliest expert only. The disk idles
# about 1 ms between a layer's last read and the next one's first, about one chunk: a second
# guess is read mostly at the step's cost, or wasted. On the 2.2 GB model (prefetch held on,
# 1.2 GB of experts held) the likeliest guesses were used 84 % of the time, the second ones
# 62 %; reading both wasted 14 MB a token, the likeliest alone 3.5 MB (docs/BENCHMARKS.md).
DECODE_READS = 1


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
    # reads over, waiting (with delay_seconds, what the throttle weighs against hidden_seconds)
    delay_seconds: float = 0.0  # step reads waiting behind chunks of guesses not used
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

    def pause(self) -> None:
        """The throttle turned prefetch off: guesses made so far will not be checked."""
        self._pending.clear()
        self.history.forget_last()

    def spent(self, seconds: float) -> None:
        """The store's thread spent this long on prefetch."""
        self.counts.cost_seconds += seconds
        self.throttle.cost += seconds

    def delayed(self, seconds: float) -> None:
        """Step reads waited this long behind the chunks of a guess that was not used."""
        self.counts.delay_seconds += seconds
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
        """Keys (target layer, expert) worth reading now, nearest layer first, best first (a
        decode token's: DECODE_READS a layer)."""
        cut = DECODE_READS if x.shape[0] == 1 else None
        keys = [(target, e) for depth, target, chosen in self.predict(layer, x, ids)
                if self._reads_wanted(target, depth) for e in chosen[:cut]]
        return keys[:self.queue_bound]

    def predict(self, layer: int, x: torch.Tensor,
                ids: torch.Tensor) -> list[tuple[int, int, list[int]]]:
        """(depth, target layer, experts best first) for each layer ahead; every guess is
        remembered for checking when its target runs, read or not."""
        at, predicted = self.layers.index(layer), []
        for depth, target in enumerate(self.layers[at + 1:at + 1 + self.depth], start=1):
            chosen = self._best(self._scores(layer, target, x, ids, depth))
            self._pending.setdefault(target, {})[depth] = set(chosen)
            predicted.append((depth, target, chosen))
        return predicted

    def _best(self, scores: torch.Tensor) -> list[int]:
        """scores [N, X] -> the union of each token's top-k experts, best first (an expert's
        best score across tokens), at most ``cap``; experts history gives 0 are left out."""
        top = torch.topk(scores, self.top_k, dim=-1)
        seen = (lambda score: True) if self.mode == "gate" else (lambda score: score > 0)
        if scores.shape[0] == 1:  # decode: one token's picks, already best first
            return [e for e, v in zip(top.indices[0].tolist(), top.values[0].tolist()) if seen(v)]
        best: dict[int, float] = {}
        for expert, score in zip(top.indices.flatten().tolist(), top.values.flatten().tolist()):
            best[expert] = max(score, best.get(expert, -math.inf))
        return sorted((e for e in best if seen(best[e])), key=lambda e: -best[e])[:self.cap]

    def _scores(self, layer: int, target: int, x: torch.Tensor, ids: torch.Tensor,
                depth: int) -> torch.Tensor:
        """[N, X], higher is likelier; gate alone: the router's logits (its softmax ranks the
        same), others probabilities, 0 where history never saw a pick."""
        if self.mode == "history":
            return self.history.scores(layer, ids, depth)
        logits = self.routers[target].logits(x)  # [N, X]
        if self.mode == "gate":
            return logits
        return (torch.softmax(logits, dim=-1) + self.history.scores(layer, ids, depth)) / 2

    def as_dict(self) -> dict:
        c = self.counts
        return {"mode": self.mode, "depth": self.depth, "reads": c.reads,
                "bytes_prefetched": c.bytes_prefetched, "used": c.used,
                "bytes_wasted": c.bytes_wasted, "cancelled": c.cancelled,
                "wait_seconds": c.wait_seconds, "hidden_seconds": c.hidden_seconds,
                "cost_seconds": c.cost_seconds, "delay_seconds": c.delay_seconds,
                "uploads": c.uploads, "adaptive": self.throttle.as_dict(),
                "layers": {t: {d: {**a.as_dict(), "reads_enabled": a.enabled and
                                   self.useful_now[t] >= MIN_PRECISION}
                               for d, a in by_depth.items()}
                           for t, by_depth in self.accuracy.items()}}


class Throttle:
    """Whether prefetch runs in the next forward, judged from the store's own counts, not from
    timed forwards (on a disk whose rate drifts, forwards minutes apart differ by more than
    prefetch gains). Prefetch runs in windows of ``WINDOW_FORWARDS`` forwards; at a window's
    end it stays on for the next one only if the read time its used guesses hid (``hidden``)
    exceeds what it cost (``cost``: the store's thread on prefetch, and the step reads' wait
    behind chunks of guesses not used). A lost window turns it off, no prediction and no reads,
    for ``RECHECK_FORWARDS`` forwards, doubling up to ``MAX_RECHECK`` while it keeps losing;
    then a window on again.
    """

    def __init__(self):
        self.on = True
        self._left = WINDOW_FORWARDS  # forwards left in this window (on) or pause (off)
        self._pause = RECHECK_FORWARDS  # how long the next lost window turns prefetch off
        self.cost = self.hidden = 0.0  # this window: seconds prefetch took from / saved the store
        self.windows = self.windows_won = self.forwards_on = self.forwards_off = 0
        self.last: tuple[float, float] | None = None  # (hidden, cost) of the last window judged

    def forward(self) -> bool:
        """A forward starts -> whether prefetch runs in it."""
        if self._left == 0:
            if self.on:
                self._judge()
            else:
                self.on, self._left = True, WINDOW_FORWARDS
        self._left -= 1
        if self.on:
            self.forwards_on += 1
        else:
            self.forwards_off += 1
        return self.on

    def _judge(self) -> None:
        won = self.hidden > self.cost
        self.windows, self.last = self.windows + 1, (self.hidden, self.cost)
        self.cost = self.hidden = 0.0
        if won:
            self.windows_won += 1
            self._left, self._pause = WINDOW_FORWARDS, RECHECK_FORWARDS
        else:
            self.on, self._left = False, self._pause
            self._pause = min(2 * self._pause, MAX_RECHECK)

    def as_dict(self) -> dict:
        hidden, cost = self.last or (0.0, 0.0)
        return {"on_now": self.on, "windows": self.windows, "windows_won": self.windows_won,
                "forwards_on": self.forwards_on, "forwards_off": self.forwards_off,
                "last_hidden_seconds": hidden, "last_cost_seconds": cost}
