"""Cache policies: hand-worked LRU/LFU sequences, Belady optimal by brute force, invariants of all."""

from __future__ import annotations

import functools
import random
from collections import Counter, OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from real_traces import SWITCH

from moeswap.routing.policies import (
    ARC, LFU, LFUDA, LRU, S3FIFO, AdmitAfter, Belady, LearnedReuse, Pinned, ReuseTable, SlidingWindow,
)
from moeswap.routing.importers import import_trace
from moeswap.routing.profile import build_profile, learn_reuse_table, use_bucket
from moeswap.routing.simulate import simulate
from moeswap.routing.traces import RoutingTrace



def replay(policy, keys):
    return "".join("H" if policy.access(k).hit else "m" for k in keys)


def test_lru_hand_worked():
    # capacity 2: a b | a hit | c evicts b (a used more recently) | b evicts a | c hit | a evicts b
    policy = LRU(2)
    steps = [policy.access(k) for k in "abacbca"]
    assert "".join("H" if s.hit else "m" for s in steps) == "mmHmmHm"
    assert [s.evicted for s in steps] == [None, None, None, "b", "a", None, "b"]
    assert policy.resident() == {"c", "a"}


def test_lfu_hand_worked_counts_survive_eviction():
    # capacity 2. a,a,b: {a:2, b:1}. c evicts b (count 1). b (count 2) evicts c (count 1).
    # c (count 2): a(2), b(2) tie -> least recently used a goes. a (count 3): b(2), c(2) tie -> b goes.
    policy = LFU(2)
    steps = [policy.access(k) for k in "aabcbca"]
    assert "".join("H" if s.hit else "m" for s in steps) == "mHmmmmm"
    assert [s.evicted for s in steps] == [None, None, None, "b", "c", "a", "b"]
    assert policy.resident() == {"c", "a"}


class OrderedDictLRU:
    """The reference: an OrderedDict in recency order, least recent first."""

    def __init__(self, capacity: int):
        self.capacity, self.held = capacity, OrderedDict()

    def access(self, key) -> tuple[bool, object]:
        """-> (hit, evicted key or None)."""
        if key in self.held:
            self.held.move_to_end(key)
            return True, None
        if self.capacity == 0:
            return False, None
        evicted = self.victim() if len(self.held) >= self.capacity else None
        self.held.pop(evicted, None)
        self.held[key] = None
        return False, evicted

    def victim(self):
        return next(iter(self.held))


class OrderedDictLFU(OrderedDictLRU):
    """LFU with counts that survive eviction; among equal counts the least recent goes."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.count = Counter()

    def access(self, key):
        self.count[key] += 1
        return super().access(key)

    def victim(self):
        return min(self.held, key=lambda k: self.count[k])  # min keeps the first (least recent)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 5), keys=st.lists(st.integers(0, 7), max_size=80),
       kind=st.sampled_from([(LRU, OrderedDictLRU), (LFU, OrderedDictLFU)]))
def test_lru_and_lfu_equal_an_ordered_dict_reference(capacity, keys, kind):
    policy, reference = kind[0](capacity), kind[1](capacity)
    for key in keys:
        step = policy.access(key)
        assert (step.hit, step.evicted) == reference.access(key), key
        assert policy.resident() == set(reference.held)


def test_lfuda_ages_out_old_favourites():
    # a is used 3 times early; with aging the cache age climbs past a's priority so a finally goes.
    policy = LFUDA(1)
    assert replay(policy, "aaab") == "mHHm"
    policy = LFUDA(2)
    steps = [policy.access(k) for k in "aaabcbcd"]
    # a=3, b=1. c evicts b (age 1), c=2. b evicts c (age 2), b=3.
    # c: a=3 and b=3 tie -> the older a goes although it was used 3 times (age 3), c=4. d evicts b.
    assert [s.evicted for s in steps] == [None, None, None, None, "b", "c", "a", "b"]


def test_sliding_window_prefers_recently_frequent():
    policy = SlidingWindow(2, window=4)
    # c: window "abbc" -> a 1 use, b 2 -> a goes. d: window "bbcd" -> b 2, c 1 -> c goes.
    steps = [policy.access(k) for k in "abbcd"]
    assert [s.evicted for s in steps] == [None, None, None, "a", "c"]


def test_s3fifo_hand_worked():
    # capacity 3, small queue of 1 slot. a b c fill the small FIFO. d: a (unused) leaves to the
    # ghost queue. b is hit. e: b (used) moves to main, c (unused) leaves. a returns from the
    # ghost queue straight to main, after d (unused, oldest in small) leaves.
    policy = S3FIFO(3)
    steps = [policy.access(k) for k in "abcdbea"]
    assert "".join("H" if s.hit else "m" for s in steps) == "mmmmHmm"
    assert [s.evicted for s in steps] == [None, None, None, "a", None, "c", "d"]
    assert list(policy.main) == ["b", "a"] and list(policy.small) == ["e"]
    assert list(policy.ghost) == ["c", "d"]


def test_admit_after_bypasses_until_nth_request():
    policy = AdmitAfter(LRU(1), n=3)
    # a fills the free slot; b bypasses twice, is admitted at its 3rd request; a (2nd) bypasses
    steps = [policy.access(k) for k in "abbbab"]
    assert "".join("H" if s.hit else "m" for s in steps) == "mmmmmH"
    assert [s.admitted for s in steps] == [True, False, False, True, False, False]
    assert steps[3].evicted == "a" and policy.resident() == {"b"}


def test_pinned_never_evicts_hot_set():
    policy = Pinned(hot=["x"], inner=LRU(1))
    assert policy.capacity == 2
    assert replay(policy, "xabxba") == "HmmHHm"
    assert "x" in policy and len(policy) == 2


def test_learned_reuse_evicts_the_expert_expected_last():
    # one age bucket; expected gap falls with uses in window: an expert used twice stays.
    table = ReuseTable(age_edges=(1 << 30,), window=4, expected_gap=((9.0, 5.0, 1.0, 1.0, 1.0),))
    policy = LearnedReuse(2, table, k=1)
    steps = [policy.access(k) for k in "aabc"]
    assert [s.evicted for s in steps] == [None, None, None, "b"]


def test_learned_reuse_never_evicts_the_current_tokens_experts():
    table = ReuseTable(age_edges=(1 << 30,), window=4, expected_gap=((1.0, 1.0, 1.0, 1.0, 1.0),))
    policy = LearnedReuse(2, table, k=2)
    # token 0: a b; token 1: c d. d must not evict c (served by the same token).
    steps = [policy.access(k) for k in "abcd"]
    assert steps[3].evicted != "c" and policy.resident() == {"c", "d"}


def test_use_counts_pool_in_doubling_buckets():
    assert [use_bucket(n) for n in range(18)] == [0, 1, 2, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6]


def test_learned_table_pools_use_counts_and_decides_the_eviction():
    # Learning trace, one layer, top-1: "a a a a b" three times (tokens 0..14), window 4 tokens.
    # Samples at age 1 (gap = tokens to the next use, 64 when none):
    #   a, 1 use: t1 -> 0 | a, 2 uses: t2 -> 0 | a, 3 uses: t3, t6-8, t11-13 -> 0 (7 samples)
    #   a, 4 uses: t4 -> 1, t9 -> 1, t14 -> 64 | b, 1 use: t5 -> 4, t10 -> 4
    # Uses 3 and 4 share a bucket: 10 samples, mean 66/10 = 6.6. The other cells have < 5 samples
    # and take the age-1 mean, 74/14. (Unpooled, "3 uses" alone would read 0.0.)
    # Age 2: a, 3 uses (t5, t10) -> 0, b (t6, t11) -> 3: mean 1.5. Age 3: b -> 2. Age 4: b -> 1.
    # Age 5 (bucket <= 6): b, 0 uses (t9, t14) -> 0. Older buckets: no samples, the horizon 64.
    a, b, c = 0, 1, 2
    ids = [[[b if t % 5 == 4 else a]] for t in range(15)]
    trace = RoutingTrace(model="m", arch="x", layers=[0], n_experts=3, k=1, prompt_offsets=[0, 15],
                         expert_ids=ids, weights=np.ones((15, 1, 1)))
    table = learn_reuse_table(trace, window=4)
    assert table.expected_gap[:5] == ((5.2857, 5.2857, 5.2857, 6.6, 6.6), (1.5,) * 5, (2.0,) * 5,
                                      (1.0,) * 5, (0.0,) * 5)
    assert all(row == (64.0,) * 5 for row in table.expected_gap[5:])
    # Replay "a a b a c a" at capacity 2. At c (token 4): a has age 1 and 3 uses in the window
    # (6.6), b age 2 (1.5) -> a, the most recent, goes. At a (token 5): b has age 3 (2.0),
    # c age 1 with 1 use (5.2857) -> c goes.
    policy = LearnedReuse(2, table, k=1)
    assert [policy.access(key).evicted for key in [a, a, b, a, c, a]] == [None, None, None, None, a, c]
    assert policy.resident() == {a, b}


@pytest.mark.parametrize("scored, learned_on", [((0, 1, 2, 3, 4), (5, 6, 7, 8, 9)),
                                                ((5, 6, 7, 8, 9), (0, 1, 2, 3, 4))])
def test_learned_policy_beats_lru_above_k_on_the_other_switch_half(scored, learned_on):
    switch = import_trace(SWITCH)
    table = build_profile(switch.select_prompts(list(learned_on)), 0, per_layer=True).reuse
    score = switch.select_prompts(list(scored))
    learned = lambda ctx: LearnedReuse(ctx.capacity, table, ctx.k)  # noqa: E731
    lru = lambda ctx: LRU(ctx.capacity)  # noqa: E731
    for capacity in range(score.k + 1, 7):  # the table: 1-6 (at 7 of 8, docs/TRACES.md)
        hits = {name: int(simulate(score, name, factory, capacity, "per-layer").hits.sum())
                for name, factory in (("lru", lru), ("learned", learned))}
        assert hits["learned"] > hits["lru"], capacity


def optimal_hits(keys: tuple, capacity: int) -> int:
    """Brute force over every admit / bypass / victim choice (the cache model of Belady here)."""

    @functools.lru_cache(maxsize=None)
    def best(i: int, cache: frozenset) -> int:
        if i == len(keys):
            return 0
        key = keys[i]
        if key in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {key}))
        else:
            options += [best(i + 1, (cache - {victim}) | {key}) for victim in cache]
        return max(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(60))
def test_belady_is_optimal_by_brute_force(seed):
    rng = random.Random(seed)
    n_keys, capacity = rng.randint(2, 5), rng.randint(1, 3)
    keys = tuple(rng.randrange(n_keys) for _ in range(rng.randint(1, 12)))
    belady_hits = replay(Belady(capacity, keys), keys).count("H")
    assert belady_hits == optimal_hits(keys, capacity)
    for online in (LRU(capacity), LFU(capacity), ARC(capacity), S3FIFO(capacity)):
        assert replay(online, keys).count("H") <= belady_hits


def test_belady_rejects_a_different_stream():
    with pytest.raises(ValueError, match="different request stream"):
        Belady(1, [1, 2]).access(2)


def make_all(capacity):
    table = ReuseTable((1, 4, 1 << 30), 3, tuple((5.0, 4.0, 3.0, 2.0) for _ in range(3)))
    return [LRU(capacity), LFU(capacity), LFUDA(capacity), SlidingWindow(capacity, 5), ARC(capacity),
            S3FIFO(capacity), AdmitAfter(LRU(capacity), 2), LearnedReuse(capacity, table, k=2)]


@pytest.mark.parametrize("capacity", [0, 1, 2, 3, 5])
def test_every_policy_keeps_its_promises(capacity):
    """hit iff resident before; never over capacity; evicted keys were resident and are gone."""
    rng = random.Random(capacity)
    for policy in make_all(capacity):
        for _ in range(400):
            key = rng.randrange(9)
            before = policy.resident()
            step = policy.access(key)
            after = policy.resident()
            assert step.hit == (key in before), type(policy).__name__
            assert len(after) <= capacity
            if step.admitted:
                assert key in after and not step.hit
            if step.evicted is not None:
                assert step.evicted in before and step.evicted not in after
            assert after - before <= {key}
            assert before - after <= {step.evicted}
            assert (key in after) == (key in policy)


def test_arc_protects_a_key_used_twice():
    # capacity 2: a (T1), a again (-> T2), b (T1); c evicts b from T1 into ghost B1, keeping a.
    # LRU evicts a instead, the least recently used.
    arc = ARC(2)
    assert replay(arc, "aabca") == "mHmmH"
    assert list(arc.b1) == ["b"] and list(arc.t2) == ["a"] and list(arc.t1) == ["c"]
    assert replay(LRU(2), "aabca") == "mHmmm"
    # b returns from the ghost list: T1 is favoured (p grows to 1) and b goes straight to T2
    step = arc.access("b")
    assert (step.hit, step.admitted, arc.p) == (False, True, 1.0) and "b" in arc.t2
