"""Cache policies for routed experts: which experts stay in fast memory.

One small interface serves both the live expert store and the trace simulator. A policy
is told of every request, in order, and answers what happened::

    step = policy.access(key)   # key: e.g. an expert id, or (layer, expert) for a global cache
    step.hit                    # the key was resident
    step.admitted               # a miss that now occupies a slot (the store loads it)
    step.evicted                # the key that left to make room (the store frees it), or None

A miss that is not admitted bypasses the cache: the expert is computed from where it
lies and nothing changes residency. Capacities count experts, not bytes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

Key = Hashable


@dataclass(frozen=True, slots=True)
class Access:
    hit: bool
    admitted: bool = False
    evicted: Key | None = None


HIT = Access(hit=True)
BYPASS = Access(hit=False)


class CachePolicy(ABC):
    """Holds at most ``capacity`` keys; ``access`` is the only call that changes them."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def access(self, key: Key) -> Access: ...

    @abstractmethod
    def resident(self) -> set: ...

    def __contains__(self, key: Key) -> bool:
        return key in self.resident()

    def __len__(self) -> int:
        return len(self.resident())


class DemandPolicy(CachePolicy):
    """A policy that admits every miss and differs only in its choice of victim."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._slots: set = set()
        self._clock = 0  # requests seen; breaks ties towards the least recently used

    def access(self, key: Key) -> Access:
        self._clock += 1
        if key in self._slots:
            self._on_hit(key)
            return HIT
        if self.capacity == 0:
            return BYPASS
        victim = None
        if len(self._slots) >= self.capacity:
            victim = self._victim(key)
            self._slots.remove(victim)
            self._on_evict(victim)
        self._slots.add(key)
        self._on_admit(key)
        return Access(hit=False, admitted=True, evicted=victim)

    def resident(self) -> set:
        return set(self._slots)

    def __contains__(self, key: Key) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @abstractmethod
    def _victim(self, incoming: Key) -> Key: ...

    def _on_hit(self, key: Key) -> None:
        self._on_admit(key)

    def _on_admit(self, key: Key) -> None: ...

    def _on_evict(self, key: Key) -> None: ...


class LRU(DemandPolicy):
    """Evicts the expert whose last request is oldest."""

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._by_use: dict = {}  # the resident keys, least recently used first

    def _on_admit(self, key):
        self._by_use[key] = self._by_use.pop(key, None)  # last: a dict keeps insertion order

    def _on_evict(self, key):
        del self._by_use[key]

    def _victim(self, incoming):
        return next(iter(self._by_use))  # O(1): a decode step's miss waits on it


class LFU(DemandPolicy):
    """Evicts the resident expert requested least often so far (counts survive eviction); ties go LRU."""

    name = "lfu"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._count: Counter = Counter()
        self._last_use: dict = {}

    def access(self, key):
        self._count[key] += 1
        return super().access(key)

    def _on_admit(self, key):
        self._last_use[key] = self._clock

    def _victim(self, incoming):
        return min(self._slots, key=lambda k: (self._count[k], self._last_use[k]))


class LFUDA(DemandPolicy):
    """LFU with dynamic aging (Arlitt et al., as in Squid): priority = uses while resident + age.

    The cache's age becomes the priority of each victim, so experts that were popular long
    ago lose to ones that are popular now.
    """

    name = "lfuda"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._age = 0.0
        self._priority: dict = {}
        self._last_use: dict = {}

    def _on_hit(self, key):
        self._priority[key] += 1
        self._last_use[key] = self._clock

    def _on_admit(self, key):
        self._priority[key] = self._age + 1
        self._last_use[key] = self._clock

    def _on_evict(self, key):
        self._age = self._priority.pop(key)
        del self._last_use[key]

    def _victim(self, incoming):
        return min(self._slots, key=lambda k: (self._priority[k], self._last_use[k]))


class SlidingWindow(DemandPolicy):
    """Evicts the expert with the fewest requests in the last ``window`` requests; ties go LRU.

    An expert not requested within the window therefore goes first, oldest first.
    """

    name = "window"

    def __init__(self, capacity: int, window: int):
        super().__init__(capacity)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._recent: deque = deque(maxlen=window)
        self._in_window: Counter = Counter()
        self._last_use: dict = {}

    def access(self, key):
        if len(self._recent) == self._recent.maxlen:
            self._in_window[self._recent[0]] -= 1
        self._recent.append(key)
        self._in_window[key] += 1
        return super().access(key)

    def _on_admit(self, key):
        self._last_use[key] = self._clock

    def _on_evict(self, key):
        del self._last_use[key]

    def _victim(self, incoming):
        return min(self._slots, key=lambda k: (self._in_window[k], self._last_use[k]))


class ARC(CachePolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), as in the paper's Figure 4.

    T1 holds keys seen once recently, T2 keys seen at least twice; the ghost lists B1, B2
    remember recent victims of each and steer the target size ``p`` of T1.
    """

    name = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.p = 0.0
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()

    def resident(self) -> set:
        return set(self.t1) | set(self.t2)

    def _replace(self, key) -> Key:
        """Move the LRU key of T1 or T2 to its ghost list and return it."""
        if self.t1 and (len(self.t1) > self.p or (key in self.b2 and len(self.t1) == self.p)):
            victim, _ = self.t1.popitem(last=False)
            self.b1[victim] = None
        else:
            victim, _ = self.t2.popitem(last=False)
            self.b2[victim] = None
        return victim

    def access(self, key):
        c = self.capacity
        if key in self.t1 or key in self.t2:
            (self.t1 if key in self.t1 else self.t2).pop(key)
            self.t2[key] = None
            return HIT
        if c == 0:
            return BYPASS
        victim = None
        if key in self.b1 or key in self.b2:
            if key in self.b1:
                self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            else:
                self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            if len(self.t1) + len(self.t2) >= c:
                victim = self._replace(key)
            (self.b1 if key in self.b1 else self.b2).pop(key)
            self.t2[key] = None
            return Access(hit=False, admitted=True, evicted=victim)
        l1 = len(self.t1) + len(self.b1)
        if l1 == c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                victim = self._replace(key)
            else:
                victim, _ = self.t1.popitem(last=False)
        elif l1 < c and l1 + len(self.t2) + len(self.b2) >= c:
            if l1 + len(self.t2) + len(self.b2) == 2 * c:
                self.b2.popitem(last=False)
            if len(self.t1) + len(self.t2) >= c:
                victim = self._replace(key)
        self.t1[key] = None
        return Access(hit=False, admitted=True, evicted=victim)


class S3FIFO(CachePolicy):
    """S3-FIFO (Yang et al., SOSP 2023): a small probation FIFO, a main FIFO and a ghost FIFO.

    New keys enter the small queue (10 % of the slots, at least one); those requested again
    while there move to main, the rest leave, remembered in the ghost queue so that a quick
    return goes straight to main. Main is a FIFO with reinsertion for keys used since.
    """

    name = "s3fifo"

    def __init__(self, capacity: int, small_share: float = 0.1):
        super().__init__(capacity)
        self.small_target = max(1, round(capacity * small_share)) if capacity > 1 else 0
        self.small: deque = deque()
        self.main: deque = deque()
        self.ghost: OrderedDict = OrderedDict()
        self.freq: dict = {}

    def resident(self) -> set:
        return set(self.freq)

    def __contains__(self, key):
        return key in self.freq

    def __len__(self):
        return len(self.freq)

    def access(self, key):
        if key in self.freq:
            self.freq[key] = min(self.freq[key] + 1, 3)
            return HIT
        if self.capacity == 0:
            return BYPASS
        evicted = self._evict() if len(self.freq) >= self.capacity else None
        if key in self.ghost or self.small_target == 0:
            self.ghost.pop(key, None)
            self.main.append(key)
        else:
            self.small.append(key)
        self.freq[key] = 0
        return Access(hit=False, admitted=True, evicted=evicted)

    def _evict(self) -> Key:
        while True:
            if self.small and (len(self.small) >= self.small_target or not self.main):
                key = self.small.popleft()
                if self.freq[key] > 0:
                    self.freq[key] = 0
                    self.main.append(key)
                    continue
                self.ghost[key] = None
                if len(self.ghost) > self.capacity:
                    self.ghost.popitem(last=False)
            else:
                key = self.main.popleft()
                if self.freq[key] > 0:
                    self.freq[key] -= 1
                    self.main.append(key)
                    continue
            del self.freq[key]
            return key


class AdmitAfter(CachePolicy):
    """Admits a missing expert only once it has been requested ``n`` times (or while slots are free).

    Residents are managed by ``inner``, which only sees the requests this filter lets through.
    """

    name = "admit"

    def __init__(self, inner: CachePolicy, n: int):
        super().__init__(inner.capacity)
        self.inner, self.n = inner, n
        self._count: Counter = Counter()

    def resident(self) -> set:
        return self.inner.resident()

    def __contains__(self, key):
        return key in self.inner

    def access(self, key):
        self._count[key] += 1
        if key in self.inner or len(self.inner) < self.capacity or self._count[key] >= self.n:
            return self.inner.access(key)
        return BYPASS


class Pinned(CachePolicy):
    """A fixed hot set (from a routing profile) that never leaves, plus ``inner`` for the other slots."""

    name = "pinned"

    def __init__(self, hot: Iterable[Key], inner: CachePolicy):
        self.hot = frozenset(hot)
        super().__init__(len(self.hot) + inner.capacity)
        self.inner = inner

    def resident(self) -> set:
        return set(self.hot) | self.inner.resident()

    def __contains__(self, key):
        return key in self.hot or key in self.inner

    def access(self, key):
        return HIT if key in self.hot else self.inner.access(key)


class Belady(CachePolicy):
    """The offline optimum for this cache model (misses may bypass): Belady's MIN with bypass.

    On a miss with all slots full, of the residents and the incoming key, the one whose next
    request lies farthest in the future stays out: if that is the incoming key the miss
    bypasses, otherwise that resident is evicted. ``requests`` is the whole future stream;
    ``access`` must then be called with exactly that sequence.
    """

    name = "belady"
    may_bypass = True  # False: every miss is admitted, the classic OPT (belady-admit)

    def __init__(self, capacity: int, requests: Sequence[Key]):
        super().__init__(capacity)
        self.requests = list(requests)
        self._next_use = [math.inf] * len(self.requests)  # position of the next request of the same key
        upcoming: dict = {}
        for i in range(len(self.requests) - 1, -1, -1):
            self._next_use[i] = upcoming.get(self.requests[i], math.inf)
            upcoming[self.requests[i]] = i
        self._position = 0
        self._slots: dict = {}  # key -> position of its next request

    def resident(self) -> set:
        return set(self._slots)

    def access(self, key):
        i = self._position
        if i >= len(self.requests) or self.requests[i] != key:
            raise ValueError(f"Belady was built for a different request stream (position {i}, key {key!r})")
        self._position += 1
        next_use = self._next_use[i]
        if key in self._slots:
            self._slots[key] = next_use
            return HIT
        if len(self._slots) < self.capacity:
            self._slots[key] = next_use
            return Access(hit=False, admitted=True)
        if not self._slots:
            return BYPASS
        farthest = max(self._slots, key=self._slots.__getitem__)
        if self.may_bypass and next_use >= self._slots[farthest]:
            return BYPASS
        del self._slots[farthest]
        self._slots[key] = next_use
        return Access(hit=False, admitted=True, evicted=farthest)


@dataclass(frozen=True)
class ReuseTable:
    """Expected tokens until an expert's next request, by how long ago and how often it was used.

    ``expected_gap[a, f]``: ``a`` indexes ``age_edges`` (the first edge >= tokens since the
    last use), ``f`` is the number of uses in the last ``window`` tokens. Learned from a
    trace by ``moeswap.routing.profile.learn_reuse_table``, which pools counts into doubling
    buckets, so neighbouring columns may repeat.
    """

    age_edges: tuple[int, ...]  # upper bounds of the age buckets, in tokens; the last one is open
    window: int
    expected_gap: tuple[tuple[float, ...], ...]  # [len(age_edges), window + 1]

    def age_bucket(self, age: int) -> int:
        return next((i for i, edge in enumerate(self.age_edges) if age <= edge), len(self.age_edges) - 1)

    def predict(self, age: int, uses_in_window: int) -> float:
        return self.expected_gap[self.age_bucket(age)][min(uses_in_window, self.window)]


class LearnedReuse(CachePolicy):
    """Evicts the resident expert whose next request a learned ``ReuseTable`` expects last.

    Ages count tokens: a token is k requests of one layer (``layer_of(key)`` says which; a
    per-layer cache has one). Experts of the token being served are never victims while
    others remain; ties go to the least recently used.
    """

    name = "learned"

    def __init__(self, capacity: int, table: ReuseTable, k: int, layer_of=lambda key: 0):
        super().__init__(capacity)
        self.table, self.k, self.layer_of = table, k, layer_of
        self._requests: Counter = Counter()  # per layer
        self._last_token: dict = {}  # resident key -> token of its last use, in its layer's clock
        self._recent: dict = {}  # layer -> deque of (token, key) within the window
        self._uses: Counter = Counter()  # key -> uses in its layer's window

    def resident(self) -> set:
        return set(self._last_token)

    def __contains__(self, key):
        return key in self._last_token

    def __len__(self):
        return len(self._last_token)

    def _token(self, layer) -> int:
        return (self._requests[layer] - 1) // self.k

    def _expected_gap(self, key) -> float:
        layer = self.layer_of(key)
        age = self._token(layer) - self._last_token[key]
        return -1.0 if age == 0 else self.table.predict(age, self._uses[key])

    def access(self, key):
        layer = self.layer_of(key)
        self._requests[layer] += 1
        token = self._token(layer)
        recent = self._recent.setdefault(layer, deque())
        recent.append((token, key))
        self._uses[key] += 1
        while recent[0][0] < token - self.table.window:
            self._uses[recent.popleft()[1]] -= 1
        if key in self._last_token:
            self._last_token[key] = token
            return HIT
        if self.capacity == 0:
            return BYPASS
        victim = None
        if len(self._last_token) >= self.capacity:
            victim = max(self._last_token, key=lambda r: (self._expected_gap(r), -self._last_token[r]))
            del self._last_token[victim]
        self._last_token[key] = token
        return Access(hit=False, admitted=True, evicted=victim)
