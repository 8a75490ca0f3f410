"""Prefetch in the expert store: output bit-identical with it on or off, for every predictor and
depth; budgets that hold; this layer's experts never evicted by a guess; stale reads cancelled;
recall and precision counted right; the gate predictor is the next router's top-k. The throttle
on its own: test_prefetch_throttle.py; uploads to the device: test_prefetch_device.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tiny_models
from moeswap.experts.prefetch import Prefetcher
from moeswap.experts.store import ExpertStore
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.tiers import piece_offsets
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_weights import GGUFWeights
from moeswap.gguf_tools.convert import convert
from moeswap.models import load_model
from moeswap.models.causal_lm import router
from moeswap.models.moe import Router
from moeswap.models.quant_experts import QuantResidentExperts
from moeswap.quant import CpuKernels
from test_expert_store import decode_logits, plan, store_model

MODES = ["gate", "history", "both"]
POLICIES = ["lru", "lfu", "lfuda", "arc", "s3fifo", "window:4", "admit:2"]


@pytest.fixture(scope="module", params=["qwen2moe", "deepseek2", "gpt_oss", "gemma4"])
def other_family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"prefetch-{request.param}")
    tiny_models.save(request.param, folder / "hf")
    return convert(folder / "hf", folder / "model.q4_0.gguf", "q4_0")


def held_on(store):
    """The throttle bypassed: no window it judges can turn prefetch off."""
    if store.lookahead is not None:
        store.lookahead.prefetch.throttle.forward = lambda: True
    return store


def reading_every_guess(store):
    """Held on, and the precision rules bypassed too: every guess is read, right or wrong."""
    if held_on(store).lookahead is not None:
        store.lookahead.prefetch._reads_wanted = lambda target, depth: True
    return store


def test_logits_are_bitwise_equal_with_prefetch_on_and_off(deep_mixtral):
    resident = load_model(deep_mixtral, threads=1, expert_runner=QuantResidentExperts)
    expected = decode_logits(resident)
    _, _, layers, _ = plan(deep_mixtral)
    for mode in MODES:
        for depth in range(5):
            for host_slots in (1, 2 * len(layers)):
                model, factory = store_model(deep_mixtral, host_slots, prefetch=mode,
                                             prefetch_depth=depth)
                reading_every_guess(factory.store)
                assert torch.equal(decode_logits(model), expected), (mode, depth, host_slots)
                assert ("prefetch" in factory.stats()) == (depth > 0)
                factory.store.close()


def test_other_families_are_exact_with_prefetch(other_family):
    resident = load_model(other_family, threads=1, expert_runner=QuantResidentExperts)
    expected = decode_logits(resident)
    _, _, layers, _ = plan(other_family)
    for mode in MODES:
        model, factory = store_model(other_family, len(layers), prefetch=mode)
        reading_every_guess(factory.store)
        assert torch.equal(decode_logits(model), expected), mode
        factory.store.close()


def routers_of(path, layers):
    gguf = GGUFFile.open(path)
    config, weights = config_from_gguf(gguf), GGUFWeights(gguf)
    return {i: router(config, weights, i) for i in layers}


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_budgets_hold_and_guesses_never_evict_this_layers_experts(deep_mixtral, data):
    gguf = GGUFFile.open(deep_mixtral)
    fixed, slot, layers, n_experts = plan(deep_mixtral)
    everything = len(layers) * n_experts
    host_budget = fixed + data.draw(st.integers(slot, (everything + 1) * slot), label="host extra")
    device_budget = data.draw(st.integers(0, 6 * slot), label="device budget")
    options = OffloadSettings(host_bytes=host_budget, device_bytes=device_budget,
                           policy=data.draw(st.sampled_from(POLICIES)),
                           miss=data.draw(st.sampled_from(["auto", "compute", "transfer"])),
                           prefetch=data.draw(st.sampled_from(MODES)),
                           prefetch_depth=data.draw(st.integers(1, 4)))
    kernels = CpuKernels(1)
    store = reading_every_guess(ExpertStore(gguf, kernels, layers, "silu", options,
                                            routers=routers_of(deep_mixtral, layers)))
    # without prefetch, with the host policy's capacity: the host slots (at most every expert)
    # less the slots reserved for guesses
    policy_slots = store.residency.pools["host"].n_slots - store.residency.guess_slots
    without = ExpertStore(gguf, kernels, layers, "silu",
                          replace(options, prefetch="off", host_bytes=fixed + policy_slots * slot))
    resident = QuantResidentExperts(gguf, kernels, layers, "silu")
    file_bytes = np.memmap(deep_mixtral, dtype=np.uint8, mode="r")
    ahead, r = store.lookahead.ahead, store.residency

    def pinned_ahead(layer, x, ids):
        needed = {(layer, e) for e in ids.flatten().tolist()}
        held = {tier: needed & set(store.residency.slots[tier]) for tier in store.residency.slots}
        ahead(layer, x, ids)
        for tier, keys in held.items():
            assert keys <= set(store.residency.slots[tier]), (tier, keys)

    store.lookahead.ahead = pinned_ahead
    for _ in range(data.draw(st.integers(1, 4), label="forwards")):
        n_tokens = data.draw(st.integers(1, 3))
        for layer in layers:
            ids = torch.tensor([data.draw(st.permutations(range(n_experts)))[:2]
                                for _ in range(n_tokens)])
            weights, x = torch.rand(n_tokens, 2), torch.randn(n_tokens, 64)
            assert torch.equal(store.run(layer, x, ids, weights),
                               resident.run(layer, x, ids, weights))
            without.run(layer, x, ids, weights)
            held = store.held_bytes()
            for tier, budget in (("host", host_budget), ("device", device_budget)):
                assert held[tier] <= budget
                assert set(store.residency.slots[tier]) == store.residency.policies[tier].resident()
                # guesses stay outside the policies: they decide exactly as without prefetch
                assert r.policies[tier].resident() == without.residency.policies[tier].resident()
            assert not set(r.guesses.slots) & set(r.slots["host"])
            assert len(r.pools["host"].holder) == (len(r.slots["host"]) + len(r.guesses.slots)
                                                   + len(r.guesses.draining))
    store.residency.guesses.settle_all()  # let reads in flight land, then check every slot's bytes
    held = [(tier, key, index) for tier in ("host", "device")
            for key, index in store.residency.slots[tier].items()]
    held += [("host", key, r.guesses.slots[key]) for key in r.guesses.filled]
    for tier, (lay, expert), index in held:
        layout, in_slot = store.layouts[lay], store.residency.pools[tier].slot(index)
        for part, offset in zip(layout.parts, piece_offsets(layout)):
            start = part.data_start + expert * part.expert_bytes
            assert np.array_equal(in_slot[offset:offset + part.expert_bytes],
                                  file_bytes[start:start + part.expert_bytes])
    store.close()


def _gated_store(path, prefetch: str, depth: int):
    """A store with room for every expert whose guesses' reads are held at a gate (the first
    chunk waits, every later guess queues up) until the store itself needs one (a stopped
    guess's chunk stays held, its slot draining) -> (store, gate, resident experts, MoE
    layers, experts per layer)."""
    gguf = GGUFFile.open(path)
    fixed, slot, layers, n_experts = plan(path)
    kernels = CpuKernels(1)
    store = ExpertStore(gguf, kernels, layers, "silu",
                        OffloadSettings(host_bytes=fixed + len(layers) * n_experts * slot,
                                     prefetch=prefetch, prefetch_depth=depth),
                        routers=routers_of(path, layers))
    reads, gate = store.residency.reads, threading.Event()
    read = reads._read_chunk
    reads._read_chunk = lambda *args: (gate.wait(), read(*args))[1]
    promote, wait = reads.promote, reads.wait  # were the store to need a held read, it gets it
    reads.promote = lambda job, landed: (gate.set(), promote(job, landed))[1]
    reads.wait = lambda job: (gate.set(), wait(job))[1]
    return store, gate, QuantResidentExperts(gguf, kernels, layers, "silu"), layers, n_experts


def test_stale_guesses_are_stopped_before_they_are_read(deep_mixtral):
    store, gate, resident, layers, n_experts = _gated_store(deep_mixtral, "gate", 2)
    reading_every_guess(store)  # every guess is wrong here: read all the same
    x, weights = torch.randn(1, 64), torch.rand(1, 2)
    reads = store.residency.reads
    stopped, stop = [], reads.stop

    def stop_and_note(job):
        started = job.state == "running"
        cancelled = stop(job)
        stopped.extend([(job, started)] if cancelled else [])
        return cancelled

    reads.stop = stop_and_note
    for layer in layers:  # every layer asks for experts nobody guessed: every guess goes stale
        unguessed = [e for e in range(n_experts) if (layer, e) not in store.residency.guesses]
        ids = torch.tensor([unguessed[:2]])
        assert torch.equal(store.run(layer, x, ids, weights), resident.run(layer, x, ids, weights))
    assert store.lookahead.prefetch.counts.cancelled == len(stopped) > 0
    # a stale guess is never read in full: one that had started stops after its chunk in
    # flight (one at a time: the others queue), the others read nothing
    assert all(job.read_bytes < job.n_bytes if started else job.read_bytes == 0
               for job, started in stopped)
    assert any(not started for _, started in stopped)
    # the last layer has run: every guess was stale, stopped and its slot freed
    assert not store.residency.guesses.reads
    guessed = set(store.residency.guesses.slots)
    assert guessed == set(store.residency.guesses.reads) | store.residency.guesses.filled
    assert not {(job.layout.layer, job.expert) for job, _ in stopped} & guessed
    guesses, pool = store.residency.guesses, store.residency.pools["host"]
    draining = list(guesses.draining)  # stopped with a chunk in flight: slots not free yet
    assert all(job.state == "running" and index in pool.holder for index, job in draining)
    gate.set()
    guesses.settle_all()
    assert not guesses.draining and all(index not in pool.holder for index, _ in draining)
    job = stopped[0][0]  # asked for later, it is read then, bit for bit
    ids = torch.tensor([[job.expert, (job.expert + 1) % n_experts]])
    out = store.run(job.layout.layer, x, ids, weights)
    assert torch.equal(out, resident.run(job.layout.layer, x, ids, weights))
    threads = list(reads._threads)
    store.close()
    assert threads and not any(thread.is_alive() for thread in threads)


def _eye_router(n: int, top_k: int) -> Router:
    return Router(torch.eye(n), top_k, normalize=True)


def test_recall_and_precision_on_a_hand_built_routing_sequence():
    routers = {i: _eye_router(4, 2) for i in range(3)}  # logits = x: a token's guess is its top 2
    p = Prefetcher("gate", 2, [0, 1, 2], routers, n_experts=4, top_k=2)
    x0 = torch.tensor([[4.0, 3.0, 0.0, 0.0]])
    p.observe(0, torch.tensor([[0, 1]]))
    assert p.guesses(0, x0, torch.tensor([[0, 1]])) == []  # nothing read before a first check
    p.observe(1, torch.tensor([[0, 2]]))  # depth 1 guessed {0, 1}: 1 hit of 2
    x1 = torch.tensor([[0.0, 0.0, 5.0, 4.0]])
    p.guesses(1, x1, torch.tensor([[0, 2]]))  # layer 2 at depth 1: {2, 3}
    p.observe(2, torch.tensor([[2, 3]]))  # depth 1: 2 of 2; depth 2 guessed {0, 1}: 0 of 2
    layers = p.as_dict()["layers"]
    assert layers[1][1] == {"guessed": 2, "actual": 2, "hits": 1, "recall": 0.5,
                                 "precision": 0.5, "reads_enabled": True}
    assert (layers[2][1]["recall"], layers[2][1]["precision"]) == (1.0, 1.0)
    assert (layers[2][2]["recall"], layers[2][2]["precision"]) == (0.0, 0.0)
    assert not layers[2][2]["reads_enabled"]  # a first check that misses: no reads
    assert layers[2][1]["reads_enabled"]
    p.observe(0, torch.tensor([[0, 1]]))
    # depth 1 only; a decode token's likeliest guess alone (a prompt's: the union of top 2s)
    assert p.guesses(0, x0, torch.tensor([[0, 1]])) == [(1, 0)]
    assert p.guesses(0, torch.cat([x0, x0]), torch.tensor([[0, 1], [0, 1]])) == [(1, 0), (1, 1)]
    for _ in range(10):  # a depth that keeps missing reads nothing, and is still measured
        p.guesses(0, x0, torch.tensor([[0, 1]]))
        p.observe(1, torch.tensor([[0, 1]]))
        p.guesses(1, x1, torch.tensor([[0, 1]]))
        p.observe(2, torch.tensor([[2, 3]]))
    assert not p.as_dict()["layers"][2][2]["reads_enabled"]
    assert p.as_dict()["layers"][2][2]["guessed"] == 22
    assert [key for key in p.guesses(0, x0, torch.tensor([[0, 1]])) if key[0] == 2] == []


def test_gate_guess_is_the_next_routers_top_k_on_this_hidden_state(deep_mixtral):
    _, _, layers, n_experts = plan(deep_mixtral)
    routers = routers_of(deep_mixtral, layers)
    p = Prefetcher("gate", 1, layers, routers, n_experts, top_k=2)
    generator = torch.Generator().manual_seed(0)
    for step in range(20):
        layer = layers[step % (len(layers) - 1)]
        x = torch.randn(2, 64, generator=generator)  # two tokens: the union of their top 2
        ids, _ = routers[layer](x)
        (_, target, guessed), = p.predict(layer, x, ids)
        expected, _ = routers[layers[layers.index(layer) + 1]](x)
        assert target == layers[layers.index(layer) + 1]
        assert set(guessed) == set(expected.flatten().tolist())


def test_history_predictor_learns_transitions():
    p = Prefetcher("history", 2, [0, 1, 2], {}, n_experts=4, top_k=1)
    for _ in range(3):  # every token: 0 -> 3 -> 1
        for layer, e in ((0, 0), (1, 3), (2, 1)):
            p.observe(layer, torch.tensor([[e]]))
    assert p.predict(0, torch.zeros(1, 4), torch.tensor([[0]])) == [(1, 1, [3]), (2, 2, [1])]


def test_run_command_prints_prefetch(tmp_path, capsys):
    from gguf_builders import mixtral

    from moeswap.cli import main

    path = mixtral().write(tmp_path / "mixtral.gguf")
    fixed, slot, layers, _ = plan(path)
    args = ["run", str(path), "-p", "abc", "-n", "14", "--temp", "0", "--threads", "1",
            "--host-mem", str(fixed + 1024 * 1024 + 2 * len(layers) * slot),
            "--prefetch", "gate", "--prefetch-depth", "1"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "prefetch (gate, depth 1):" in err, err
    assert "prefetch layer 1: depth 1: recall" in err, err


def test_long_run_keeps_one_worker_and_exact_output(deep_mixtral):
    """A tiny budget, guesses four layers ahead, 800 layer steps (the 10,000-step run on the
    shipped model is `moeswap bench --suite prefetch stress`, docs/OFFLOAD.md)."""
    gguf = GGUFFile.open(deep_mixtral)
    fixed, slot, layers, n_experts = plan(deep_mixtral)
    kernels = CpuKernels(1)
    before = set(threading.enumerate())  # threads of this process that are not the store's
    store = ExpertStore(gguf, kernels, layers, "silu",
                        OffloadSettings(host_bytes=fixed + 3 * slot, prefetch="both",
                                     prefetch_depth=4), routers=routers_of(deep_mixtral, layers))
    reading_every_guess(store)  # random routing: no guess would earn its reads
    resident = QuantResidentExperts(gguf, kernels, layers, "silu")
    generator = torch.Generator().manual_seed(1)
    threads = []
    for step in range(160):
        for layer in layers:
            x = torch.randn(1, 64, generator=generator)
            ids = torch.randperm(n_experts, generator=generator)[:2][None]
            weights = torch.rand(1, 2, generator=generator)
            assert torch.equal(store.run(layer, x, ids, weights),
                               resident.run(layer, x, ids, weights))
        threads.append(frozenset(set(threading.enumerate()) - before))
    # guesses and misses share the same --read-depth reader threads, started once
    assert all(t.name.startswith("moeswap-read") for ts in threads for t in ts)
    assert len({ts for ts in threads}) == 1 and len(threads[0]) == store.settings.read_depth
    assert store.lookahead.prefetch.counts.reads > 0
    assert len(store.residency.guesses.reads) <= store.lookahead.prefetch.queue_bound
    store.close()
    assert not any(t.is_alive() for t in threads[-1])


def test_a_throttled_store_predicts_nothing_and_drops_waiting_reads(deep_mixtral):
    store, gate, resident, layers, n_experts = _gated_store(deep_mixtral, "both", 4)
    reading_every_guess(store)
    calls, guesses = [], store.lookahead.prefetch.guesses
    store.lookahead.prefetch.guesses = lambda *args: calls.append(args[0]) or guesses(*args)
    plan_on = iter([True, False, False])
    store.lookahead.prefetch.throttle.forward = lambda: next(plan_on)
    generator = torch.Generator().manual_seed(2)
    for forward in range(3):
        for layer in layers[:2]:  # two MoE layers: reads for layers 1-4 stay queued at the gate
            x = torch.randn(1, 64, generator=generator)
            ids = torch.randperm(n_experts, generator=generator)[:2][None]
            weights = torch.rand(1, 2, generator=generator)
            assert torch.equal(store.run(layer, x, ids, weights),
                               resident.run(layer, x, ids, weights))
        if forward == 0:
            assert calls == layers[:2] and store.residency.reads.waiting > 0
    assert calls == layers[:2]  # off: no prediction at all
    assert store.residency.reads.waiting == 0 and store.lookahead.prefetch._pending == {}
    # at most the read held at the gate is left, running (settled when its slot is next used)
    assert [job.state for job in store.residency.guesses.reads.values()] in ([], ["running"])
    gate.set()
    store.close()


def test_predicting_while_the_steps_reads_run_is_not_counted_a_cost(deep_mixtral):
    gguf = GGUFFile.open(deep_mixtral)
    fixed, slot, layers, n_experts = plan(deep_mixtral)
    store = held_on(ExpertStore(gguf, CpuKernels(1), layers, "silu",
                                OffloadSettings(host_bytes=fixed + len(layers) * n_experts * slot,
                                                prefetch="gate"),
                                routers=routers_of(deep_mixtral, layers)))
    gate, read_piece = threading.Event(), store.residency.disk.read_piece
    store.residency.disk.read_piece = lambda *args: (gate.wait(60), read_piece(*args))[1]
    guesses = store.lookahead.prefetch.guesses

    def slow_guesses(layer, x, ids):  # the step's reads wait at the gate meanwhile
        time.sleep(0.05)
        gate.set()
        return guesses(layer, x, ids)

    store.lookahead.prefetch.guesses = slow_guesses
    x, weights, ids = torch.randn(1, 64), torch.rand(1, 2), torch.tensor([[0, 1]])
    counts = store.lookahead.prefetch.counts
    store.run(layers[0], x, ids, weights)  # two misses, read while the predictor runs
    assert counts.cost_seconds < 0.05
    store.run(layers[0], x, ids, weights)  # two hits: nothing read, the store waits for it
    assert counts.cost_seconds >= 0.05
    store.close()
