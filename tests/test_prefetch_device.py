"""GPU prefetch: uploads on a copy stream, ordered by events (logic checked on CPU tensors):
a slot is read only after its upload, a ring buffer reused only after its copy, and guesses
uploaded ahead within the device budget, each slot holding its expert's bytes."""

from __future__ import annotations

import numpy as np
import torch

from moeswap.experts.device import TorchDeviceSlots
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.store import ExpertStore
from moeswap.experts.tiers import piece_offsets
from moeswap.formats.gguf_file import GGUFFile
from moeswap.quant import CpuKernels
from test_expert_store import plan
from test_prefetch import reading_every_guess, routers_of


class _DeferredCopies:
    """A copy stream that runs its copies, in order, only when one of their events is waited
    on: a slot read before its event was waited on, or a ring buffer reused before its copy ran,
    would hold the wrong bytes."""

    def __init__(self):
        self.queue: list[tuple[torch.Tensor, torch.Tensor, object]] = []
        self.log: list[str] = []

    def copy(self, target, source):
        event = _Event(self)
        self.queue.append((target, source, event))
        return event

    def run_until(self, event) -> None:
        while any(e is event for _, _, e in self.queue):
            target, source, done = self.queue.pop(0)
            target.copy_(source)

    def compute_waits(self, event) -> None:
        self.log.append("compute waits")
        self.run_until(event)


class _Event:
    def __init__(self, copies):
        self.copies = copies

    def synchronize(self):
        self.copies.log.append("host waits")
        self.copies.run_until(self)


def test_device_slots_wait_for_their_upload_and_reuse_the_ring_only_after_its_copy():
    slots = TorchDeviceSlots("cpu", n_slots=3, slot_size=64, ring=2)
    slots.copies = copies = _DeferredCopies()
    slots.pool.zero_()
    sources = [np.full(64, value, dtype=np.uint8) for value in (1, 2, 3)]
    slots.upload(0, sources[0])
    slots.upload(1, sources[1])
    assert copies.log == [] and not slots.slot(0).any()  # both copies in flight
    slots.upload(2, sources[2])  # ring buffer 0 again: its copy into slot 0 must run first
    assert copies.log == ["host waits"] and bool((slots.slot(0) == 1).all())
    assert not slots.slot(2).any()
    layout = type("Layout", (), {"parts": [], "matrices": {}, "biases": {}})()
    slots.expert(2, layout)  # the first reader of slot 2 waits on its upload's event
    assert copies.log == ["host waits", "compute waits"]
    assert [int(slots.slot(i)[0]) for i in range(3)] == [1, 2, 3]
    slots.expert(2, layout)  # later readers need no wait: the stream order holds
    assert copies.log == ["host waits", "compute waits"]


def _device_store(path, device_slots, prefetch):
    gguf = GGUFFile.open(path)
    fixed, slot, layers, n_experts = plan(path)
    store = ExpertStore(gguf, CpuKernels(1), layers, "silu",
                        OffloadSettings(host_bytes=fixed + 2 * len(layers) * slot,
                                     device_bytes=device_slots * slot, miss="transfer",
                                     device_backend="cpu", prefetch=prefetch, prefetch_depth=2),
                        routers=routers_of(path, layers))
    store.residency.pools["device"].copies = _DeferredCopies()
    return reading_every_guess(store)


def test_guesses_are_uploaded_ahead_exactly_within_the_device_budget(deep_mixtral):
    _, slot, layers, n_experts = plan(deep_mixtral)
    device_slots = 5
    with_prefetch = _device_store(deep_mixtral, device_slots, "gate")
    without = _device_store(deep_mixtral, device_slots, "off")
    routers = with_prefetch.lookahead.prefetch.routers
    file_bytes = np.memmap(deep_mixtral, dtype=np.uint8, mode="r")
    generator = torch.Generator().manual_seed(3)
    for step in range(12):
        x = torch.randn(2, 64, generator=generator)  # every layer sees it: the guesses are right
        for layer in layers:
            ids, weights = routers[layer](x)
            needed = {(layer, e) for e in ids.flatten().tolist()}
            on_device = needed & set(with_prefetch.residency.slots["device"])
            assert torch.equal(with_prefetch.run(layer, x, ids, weights),
                               without.run(layer, x, ids, weights))  # both computed there
            assert with_prefetch.held_bytes()["device"] <= device_slots * slot
            assert on_device <= set(with_prefetch.residency.slots["device"])  # guesses evicted none
            pending = with_prefetch.lookahead._to_upload
            assert all(key[0] > layer for key in pending)  # stale device guesses dropped
    assert with_prefetch.lookahead.prefetch.counts.uploads > 0
    assert with_prefetch.stats()["total"]["device_hits"] > without.stats()["total"]["device_hits"]
    pool = with_prefetch.residency.pools["device"]
    if pool.copies.queue:  # the copies still in flight land
        pool.copies.run_until(pool.copies.queue[-1][2])
    for key, index in with_prefetch.residency.slots["device"].items():  # each holds its expert
        layout = with_prefetch.layouts[key[0]]
        for part, offset in zip(layout.parts, piece_offsets(layout)):
            start = part.data_start + key[1] * part.expert_bytes
            assert np.array_equal(pool.slot(index)[offset:offset + part.expert_bytes].numpy(),
                                  file_bytes[start:start + part.expert_bytes])
    with_prefetch.close()
