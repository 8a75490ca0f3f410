"""Where a prefetch guess may sit: free host slots, the slots reserved for guesses (which keep
the policy's latest victims between guesses) or older unused guesses' slots, never a slot the
host policy holds; and, throttled off, the reserve costs nothing: with LRU the store reads exactly
what a prefetch-off store with the same budget reads, step by step.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tiny_models
from moeswap.experts.guesses import reserved_slots
from moeswap.experts.store import ExpertStore
from moeswap.experts.settings import OffloadSettings
from moeswap.formats.gguf_file import GGUFFile
from moeswap.gguf_tools.convert import convert
from moeswap.models.quant_experts import QuantResidentExperts
from moeswap.quant import CpuKernels
from test_expert_store import plan
from test_prefetch import held_on, routers_of


@pytest.fixture(scope="module")
def wide_mixtral(tmp_path_factory):
    """Three MoE layers of sixteen experts: enough host slots for a reserve (one in eight)."""
    folder = tmp_path_factory.mktemp("reserve")
    tiny_models.save("mixtral", folder / "hf", num_local_experts=16, num_hidden_layers=3)
    return convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")


# -- fixed guesses on a few host slots -------------------------------------------------------

def _fixed_guess_store(path, guesses_at: dict, host_slots: int = 4):
    """``host_slots`` host slots (four: too few to reserve any for guesses), LRU; prefetch held
    on with the guesses ``guesses_at[layer]``."""
    gguf = GGUFFile.open(path)
    fixed, slot, layers, _ = plan(path)
    settings = OffloadSettings(host_bytes=fixed + host_slots * slot, prefetch="gate",
                               prefetch_depth=2)
    store = held_on(ExpertStore(gguf, CpuKernels(1), layers, "silu", settings,
                                routers=routers_of(path, layers)))
    asked, ahead = [], store.lookahead.ahead
    store.lookahead.prefetch.guesses = lambda layer, x, ids: (asked.append(layer)
                                                              or guesses_at.get(layer, []))
    store.residency.reads.hold = lambda: None  # guesses may read before the step's own reads

    def ahead_and_land(layer, x, ids):  # each step's guesses land before it goes on
        ahead(layer, x, ids)
        for job in list(store.residency.guesses.reads.values()):
            deadline = time.monotonic() + 60  # a lost read fails here, not at the run's ceiling
            while job.state != "done":
                assert time.monotonic() < deadline, f"a guessed read never landed ({job.state})"
                time.sleep(0.001)

    store.lookahead.ahead = ahead_and_land
    return store, QuantResidentExperts(gguf, store.kernels, layers, "silu"), asked


def _step(store, resident, layer, experts):
    x, weights = torch.randn(1, 64), torch.rand(1, 2)
    ids = torch.tensor([experts])
    assert torch.equal(store.run(layer, x, ids, weights), resident.run(layer, x, ids, weights))


def test_a_guess_never_evicts_a_requested_expert(deep_mixtral):
    store, resident, asked = _fixed_guess_store(deep_mixtral, {2: [(3, 6), (3, 7), (4, 5)]})
    r, prefetch = store.residency, store.lookahead.prefetch
    _step(store, resident, 0, [0, 1])  # the guesses for layer 0: none
    _step(store, resident, 1, [0, 1])  # four requested experts fill the four slots
    requested = {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert r.policies["host"].resident() == requested
    asked.clear()
    _step(store, resident, 2, [0, 1])  # evicts two requested (LRU), as without prefetch
    assert asked == [] and not r.guesses.slots  # no room: nothing predicted, nothing read
    assert r.policies["host"].resident() == {(1, 0), (1, 1), (2, 0), (2, 1)}
    assert prefetch.counts.reads == 0
    store.close()


def test_an_unused_guess_is_the_first_evicted(deep_mixtral):
    store, resident, _ = _fixed_guess_store(deep_mixtral, {0: [(2, 5), (2, 6), (3, 7)]})
    r, prefetch = store.residency, store.lookahead.prefetch
    # the requests take two slots; once their reads are issued two guesses take the free two,
    # and the third finds none: guesses never touch a requested expert
    _step(store, resident, 0, [0, 1])
    assert list(r.guesses.slots) == [(2, 5), (2, 6)]
    assert r.policies["host"].resident() == set(r.slots["host"]) == {(0, 0), (0, 1)}
    _step(store, resident, 1, [0, 1])  # the requests need their slots: the unused guesses go
    assert not r.guesses.slots
    assert r.policies["host"].resident() == {(0, 0), (0, 1), (1, 0), (1, 1)}
    counts = prefetch.counts
    assert (counts.reads, counts.used, counts.cancelled) == (2, 0, 0)
    assert counts.bytes_wasted == 2 * store.layouts[2].expert_bytes
    assert prefetch.useful_now[2] < 1.0  # the reads' uselessness is noted per target
    store.close()


def test_a_used_guess_is_promoted_like_a_request(deep_mixtral):
    store, resident, _ = _fixed_guess_store(deep_mixtral, {0: [(1, 5)]})
    r, prefetch = store.residency, store.lookahead.prefetch
    _step(store, resident, 0, [0, 1])  # the guess takes a free slot; the requests two more
    assert list(r.guesses.slots) == [(1, 5)] and (1, 5) not in r.policies["host"]
    before = r.disk.stats.bytes
    _step(store, resident, 1, [5, 6])  # (1, 5) is used: into the policy, its bytes not read again
    assert not r.guesses.slots and (1, 5) in r.policies["host"]
    stats = store.layer_stats[1]
    assert (stats.host_hits, stats.disk_misses) == (1, 1)
    assert r.disk.stats.bytes - before == store.layouts[1].expert_bytes  # (1, 6) only
    assert prefetch.counts.used == 1 and prefetch.counts.hidden_seconds > 0
    _step(store, resident, 2, [0, 1])  # LRU: the older requests go, the used guess stays
    assert r.policies["host"].resident() == {(1, 5), (1, 6), (2, 0), (2, 1)}
    store.close()


def test_reserved_slots_are_top_k_per_layer_ahead_at_most_an_eighth():
    assert [reserved_slots(64, 2, d) for d in (1, 2, 4)] == [2, 4, 8]
    assert [reserved_slots(24, 2, d) for d in (1, 2, 4)] == [2, 3, 3]
    assert reserved_slots(7, 2, 4) == 0


def test_reserved_slots_take_guesses_when_requests_fill_the_policy(deep_mixtral):
    # 16 host slots, depth 2: two reserved for guesses, the LRU policy holds 14
    store, resident, _ = _fixed_guess_store(deep_mixtral, guesses := {}, host_slots=16)
    r, prefetch = store.residency, store.lookahead.prefetch
    assert r.guess_slots == 2
    warm = [(layer, [0, 1]) for layer in range(5)] + [(0, [2, 3]), (1, [2, 3])]
    for layer, experts in warm:
        _step(store, resident, layer, experts)
    requested = {(layer, e) for layer, experts in warm for e in experts}
    assert r.policies["host"].resident() == set(r.slots["host"]) == requested
    assert r.pools["host"].n_free == 2 and prefetch.counts.reads == 0
    guesses[2] = [(3, 6), (3, 7), (4, 5)]
    _step(store, resident, 2, [2, 3])  # the two best guesses take the reserve, the third waits;
    # the LRU victims (0, 0), (0, 1) kept there give their slots to the admissions, not the reads
    assert list(r.guesses.slots) == [(3, 6), (3, 7)] and prefetch.counts.reads == 2
    requested = requested - {(0, 0), (0, 1)} | {(2, 2), (2, 3)}  # LRU of 14, as without
    assert r.policies["host"].resident() == set(r.slots["host"]) == requested
    before = r.disk.stats.bytes
    _step(store, resident, 3, [6, 0])  # (3, 6) used: promoted, LRU's victim (1, 0) leaves
    assert r.disk.stats.bytes == before  # a guess and a host hit: nothing read
    assert r.policies["host"].resident() == requested - {(1, 0)} | {(3, 6)}
    # the victim keeps its slot in the reserve; (3, 7), its layer passed, is kept, counted
    # wasted; the reserve is whole
    assert list(r.guesses.slots) == [(3, 7), (1, 0)] and not r.pools["host"].n_free
    assert prefetch.counts.used == 1
    assert prefetch.counts.bytes_wasted == store.layouts[3].expert_bytes
    hits = store.layer_stats[1].host_hits
    _step(store, resident, 1, [0, 4])  # (1, 0) again: a host hit, back in the policy, LRU's
    # victim (1, 1) kept; (1, 4) a miss, its victim (2, 0) kept, and its admission takes the
    # oldest kept slot, (3, 7)'s
    assert r.disk.stats.bytes - before == store.layouts[1].expert_bytes
    assert store.layer_stats[1].host_hits == hits + 1
    assert r.policies["host"].resident() == \
        requested - {(1, 1), (2, 0)} | {(3, 6), (1, 4)} == set(r.slots["host"])
    assert list(r.guesses.slots) == [(1, 1), (2, 0)] and not r.pools["host"].n_free
    assert store.held_bytes()["host"] <= r.budgets["host"]
    store.close()


# -- the reserve while the throttle has prefetch off --------------------------------------------

def _reads(store) -> list[int]:
    return [s.disk_misses for s in store.layer_stats.values()]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_throttled_off_the_reserve_reads_what_prefetch_off_reads(wide_mixtral, data):
    gguf = GGUFFile.open(wide_mixtral)
    fixed, slot, layers, n_experts = plan(wide_mixtral)
    slots = data.draw(st.integers(8, len(layers) * n_experts), label="host slots")
    depth = data.draw(st.integers(1, 4), label="depth")
    options = OffloadSettings(host_bytes=fixed + slots * slot, policy="lru", prefetch="history",
                           prefetch_depth=depth)
    kernels = CpuKernels(1)
    reserve = ExpertStore(gguf, kernels, layers, "silu", options)
    reserve.lookahead.prefetch.throttle.forward = lambda: False
    assert reserve.residency.guess_slots == min(2 * depth, slots // 8) > 0
    off = ExpertStore(gguf, kernels, layers, "silu", OffloadSettings(
        host_bytes=fixed + slots * slot, policy="lru", prefetch="off"))
    resident = QuantResidentExperts(gguf, kernels, layers, "silu")
    hot = data.draw(st.integers(2, n_experts), label="experts in use")  # skew: reuse happens
    for _ in range(data.draw(st.integers(1, 12), label="tokens")):
        for layer in layers:
            experts = data.draw(st.lists(st.integers(0, hot - 1), min_size=2, max_size=2,
                                         unique=True))
            x, weights = torch.randn(1, 64), torch.rand(1, 2)
            ids = torch.tensor([experts])
            expected = resident.run(layer, x, ids, weights)
            assert torch.equal(reserve.run(layer, x, ids, weights), expected)
            assert torch.equal(off.run(layer, x, ids, weights), expected)
            assert _reads(reserve) == _reads(off)
            held = set(reserve.residency.slots["host"]) | set(reserve.residency.guesses.slots)
            assert held == set(off.residency.slots["host"])
    assert reserve.lookahead.prefetch.counts.reads == 0
    reserve.close()
