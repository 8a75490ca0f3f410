"""Residency: which tier holds each routed expert, under byte budgets, and its bytes in slots.

Tiers, fastest first: ``device`` slots, ``host`` slots (both fixed ``SlotPool``s holding experts
in their stored, quantized form; on a CPU-only machine both are RAM and compute-ready as they
are), and ``disk`` (the model file, read with ``pread``). Each tier with slots has a cache policy
from ``moeswap.routing.policies`` (the same classes the trace simulator replays) over keys
``(layer, expert)``; the policy decides residency, the slots follow it. The host budget first
pays what ``moeswap.memory.HostCharge`` sums; what is left is host slots.

For each expert a layer step needs, ``serve``:

1. uses the device slot when the device policy holds the expert (a device hit);
2. otherwise finds the bytes: a host slot (a host hit), a prefetched guess, or the file (a disk
   miss, read into a host slot when the host policy admits it, else into a staging slot);
3. asks the cost model (``MissPlanner``) whether to move the expert into a device slot
   ("transfer", when the device policy admits it) or compute it where its bytes are ("compute").
"""

from __future__ import annotations

import time
import weakref

import numpy as np

from moeswap.errors import MoeswapError
from moeswap.experts.cost import MissPlanner, Rates
from moeswap.experts.device import DEVICE_TYPES, TorchDeviceSlots, device_type_names
from moeswap.experts.disk_reads import ParallelReads
from moeswap.experts.guesses import HostGuesses, reserved_slots
from moeswap.experts.lowbit import LowBitCopies
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.stats import LayerStats
from moeswap.experts.step_reads import StepReads
from moeswap.experts.tiers import DiskReader, SlotPool
from moeswap.formats.config import ModelConfig
from moeswap.formats.gguf_file import GGUFFile
from moeswap.memory import HostCharge
from moeswap.models.quant_experts import ExpertLayout
from moeswap.routing import policies as p
from moeswap.routing.policy_specs import live_policy

Key = tuple[int, int]  # (layer, expert)
Place = tuple[str, int]  # (pool name, slot)

# Rates used when none are measured: a CPU-only machine, where computing in place always wins.
CPU_ONLY_RATES = Rates(disk_read=1e9, link=1e10, host_compute=1e10, device_compute=1e10)


class Residency:
    def __init__(self, gguf: GGUFFile, config: ModelConfig, layouts: dict[int, ExpertLayout],
                 slot_size: int, shared_bytes: int, settings: OffloadSettings,
                 charge: HostCharge, rates: Rates | None):
        self.layouts, self.slot_size = layouts, slot_size
        layers = list(layouts)
        # Disk reads that no tier admits land in a ring of staging slots, one per pick of a token.
        self.staging = SlotPool("staging", max(config.n_expert_used, 1), slot_size)
        self._ring_next = 0
        self.disk = DiskReader(gguf.piece_paths, cold=settings.cold_reads)
        self.reads = ParallelReads(self.disk, settings.read_depth)
        # the reader threads hold no reference to this object: collecting it stops them
        self.close_reads = weakref.finalize(self, self.reads.close)
        # an approximation (moeswap.experts.lowbit): its copies are charged to the host budget
        self.lowbit = (LowBitCopies(gguf, layouts, settings.miss_lowbit)
                       if settings.miss_lowbit else None)
        paid = (config, shared_bytes, self.staging.nbytes,
                self.lowbit.nbytes if self.lowbit is not None else 0)
        self.charge, charged = charge.terms(*paid), charge.bytes(*paid)
        if settings.host_bytes < charged:
            raise MoeswapError(charge.shortfall(settings.host_bytes, self.charge, slot_size))
        # Slots past one per routed expert would never be filled: a budget larger than the
        # experts (--host-mem 32GiB on a small model) allocates only what can be held.
        n_keys = sum(layout.n_experts for layout in layouts.values())
        host_slots = min(n_keys, (settings.host_bytes - charged) // slot_size) if slot_size else 0
        device_slots = min(n_keys, settings.device_bytes // slot_size) if slot_size else 0
        self.budgets = {"host": settings.host_bytes, "device": settings.device_bytes}
        self.charged = {"host": charged, "device": 0}
        self.on_torch_device = settings.device_backend != "ram"
        self.pools = {"device": self._device_pool(settings.device_backend, device_slots),
                      "host": SlotPool("host", host_slots, slot_size)}
        # --miss-lowbit turns prefetch off: a guess or a kept victim is served at full
        # precision where prefetch off would compute the miss from its low-bit copy
        self.prefetching = bool(settings.prefetch != "off" and settings.prefetch_depth > 0
                                and host_slots and not settings.miss_lowbit)
        # host slots only guesses take (moeswap.experts.guesses): the host policy has fewer
        self.guess_slots = (reserved_slots(host_slots, config.n_expert_used,
                                           settings.prefetch_depth) if self.prefetching else 0)
        self.policies: dict[str, p.CachePolicy] = {}
        for tier, pool in self.pools.items():  # device first: the host pins only what it did not
            held_faster = frozenset(key for policy in self.policies.values()
                                    for key in policy.resident())
            self.policies[tier] = live_policy(
                settings.policy, pool.n_slots - (self.guess_slots if tier == "host" else 0),
                config.n_expert_used, layers, layouts[layers[0]].n_experts, str(gguf.path),
                held_faster)
        self.slots: dict[str, dict[Key, int]] = {"device": {}, "host": {}}
        # With no device slots a step's misses are read while its other experts compute
        # (moeswap.experts.step_reads); a device transfer needs the bytes at once.
        self.overlapped = not self.pools["device"].n_slots
        self.step = StepReads(self)
        self.planner = MissPlanner(settings.miss, rates or CPU_ONLY_RATES)
        self.layer_stats = {i: LayerStats() for i in layers}
        self.guesses: HostGuesses | None = None  # prefetched, in host slots, not yet used
        self.step_keys: set[Key] = set()  # the experts of the running layer step

    def _device_pool(self, backend: str, n_slots: int) -> SlotPool | TorchDeviceSlots:
        if backend == "ram":
            return SlotPool("device", n_slots, self.slot_size)
        odd = sorted({p.name for layout in self.layouts.values() for p in layout.matrices.values()
                      if p.ggml_type not in DEVICE_TYPES})
        if odd and n_slots:
            raise MoeswapError(f"'{odd[0]}' has a type the {backend} device tier cannot compute "
                               f"yet (it computes {device_type_names()}); leave --device-mem at 0")
        return TorchDeviceSlots(backend, n_slots, self.slot_size)

    def prefill_policies(self) -> None:
        """Read in what the policies hold before any request (a pinned hot set)."""
        for tier, policy in self.policies.items():
            for key in sorted(policy.resident()):
                staged = self.read_from_disk(key, self.layer_stats[key[0]])
                self.load(tier, key, self.staging.slot(staged))

    def serve(self, layer: int, expert: int, n_tokens: int, stats: LayerStats) -> Place:
        """Make the expert's bytes available as the policies decide -> (pool, slot) holding them."""
        key = (layer, expert)
        device = self.policies["device"]
        if key in device:
            device.access(key)
            stats.device_hits += 1
            return "device", self.slots["device"][key]
        host = self.policies["host"]
        if key in host:
            host.access(key)
            stats.host_hits += 1
            source = ("host", self.slots["host"][key])
            if key in self.step.unfilled:  # its read failed in an earlier step
                self.step.read_into_host(key, source[1], stats)
        elif self.guesses is not None and key in self.guesses:
            source = ("host", self._use_guess(key, stats))
        else:
            # This step's other experts stay: evicting one would only read it again for the
            # second pass (or its own request later in the step).
            admitted = self.admit("host", key, self.step_keys - {key})
            if self.lowbit is not None and not admitted:  # the approximation fires
                stats.computed_in_place += 1
                return self.lowbit.serve(key)
            stats.disk_misses += 1
            if admitted:
                if self.guesses is not None and not self.pools["host"].n_free:
                    self.guesses.make_room(self.step_keys)  # unused guesses go first
                source = ("host", self.pools["host"].take(key))
                self.slots["host"][key] = source[1]
                self.step.read_into_host(key, source[1], stats)
            elif self.overlapped:  # read by the store's passes (moeswap.experts.step_reads)
                stats.computed_in_place += 1
                return "queued", expert
            else:
                source = ("staging", self.read_from_disk(key, stats))
        if self.pools["device"].n_slots and \
                self.planner.choose(self.layouts[layer].expert_bytes, n_tokens) == "transfer":
            step = device.access(key)
            if step.admitted:
                self.evict("device", step.evicted, stats)
                started = time.perf_counter()
                self.load("device", key, self.slot_array(*source))
                stats.stall_seconds += time.perf_counter() - started
                stats.transfers += 1
                stats.transfer_bytes += self.layouts[layer].expert_bytes
                return "device", self.slots["device"][key]
        stats.computed_in_place += 1
        return source

    def _use_guess(self, key: Key, stats: LayerStats) -> int:
        """A request for a guess: its slot, with its bytes (a read still filling it is taken
        over at the step's priority; read now if its read failed), and the host policy asked
        in as without prefetch -> the slot."""
        index, ready, filling = self.guesses.take(key)
        if ready:
            stats.host_hits += 1
        elif filling is not None:  # a miss still: the step may wait for the disk
            stats.disk_misses += 1
            if self.overlapped:  # computed when it lands, as a miss's read
                self.step.pending[key] = index, self.step.promote(filling)
            else:
                started = time.perf_counter()
                filling.result()
                stats.stall_seconds += time.perf_counter() - started
        else:  # its read failed: read it now (and report)
            stats.disk_misses += 1
            layout, before = self.layouts[key[0]], self.disk.stats.seconds
            self.disk.read_expert(layout, key[1], self.pools["host"].slot(index))
            stats.stall_seconds += self.disk.stats.seconds - before
            stats.disk_bytes += layout.expert_bytes
        if self.admit("host", key, self.step_keys - {key}):  # as a miss would be
            self.slots["host"][key] = index
        else:
            self.guesses.keep(key, index)
        return index

    def still_held(self, key: Key, place: Place, stats: LayerStats) -> Place:
        """Where the expert's bytes are for the second pass: where they were, unless evicted."""
        pool, index = place
        if self.pool(pool).holder.get(index) == key:
            return place
        stats.refetches += 1
        for tier in ("device", "host"):
            if key in self.slots[tier]:
                return tier, self.slots[tier][key]
        return "staging", self.read_from_disk(key, stats)

    def read_from_disk(self, key: Key, stats: LayerStats) -> int:
        """Read an expert into the next staging slot of the ring; returns that slot."""
        layout, index = self.layouts[key[0]], self._ring_next
        self._ring_next = (index + 1) % self.staging.n_slots
        self.staging.holder[index] = key
        before = self.disk.stats.seconds
        self.disk.read_expert(layout, key[1], self.staging.slot(index))
        stats.stall_seconds += self.disk.stats.seconds - before
        stats.disk_bytes += layout.expert_bytes
        return index

    def load(self, tier: str, key: Key, source: np.ndarray) -> int:
        """Copy an expert's bytes into a free slot of ``tier``; returns the slot."""
        pool = self.pools[tier]
        index = pool.take(key)
        if tier == "device" and self.on_torch_device:
            pool.upload(index, source)
        else:
            pool.slot(index)[:] = source
        self.slots[tier][key] = index
        return index

    def evict(self, tier: str, key: Key | None, stats: LayerStats) -> None:
        if key is None:
            return
        index = self.slots[tier].pop(key)
        if tier == "host" and self.guess_slots:
            # the reserve keeps it, bytes in, until a guess or an admission needs the slot
            self.guesses.keep(key, index)
        else:
            self.pools[tier].release(index)
        if tier == "device":
            stats.device_evictions += 1
        else:
            stats.host_evictions += 1

    def admit(self, tier: str, key: Key, pinned: set) -> bool:
        """``key`` (a miss or a guess) asks ``tier``'s policy in; a pinned victim goes back and
        what that evicts leaves instead; freed slots follow the policy -> whether ``key`` is in."""
        policy = self.policies[tier]
        step = policy.access(key)
        if not step.admitted:
            return False
        gone = [] if step.evicted is None else [step.evicted]
        touched = {key, *gone}
        for _ in range(len(pinned)):
            back = next((k for k in gone if k in pinned), None)
            if back is None:
                break
            gone.remove(back)
            again = policy.access(back)
            if again.evicted is not None:
                gone.append(again.evicted)
                touched.add(again.evicted)
        for k in touched:  # the policy has decided; the slots follow it
            if k in self.slots[tier] and k not in policy:
                self.evict(tier, k, self.layer_stats[k[0]])
        return key in policy

    def ready(self, key: Key) -> bool:
        """Whether ``key``'s bytes are in a slot now (held, and not a guess still reading)."""
        return self.holds(key) and not (self.guesses is not None
                                        and self.guesses.in_flight(key))

    def holds(self, key: Key) -> bool:
        """Whether a tier's policy or an unused guess holds ``key``."""
        return (key in self.policies["device"] or key in self.policies["host"]
                or (self.guesses is not None and key in self.guesses))

    def pool(self, name: str) -> SlotPool:
        if name == "lowbit":
            return self.lowbit.pool
        return self.staging if name == "staging" else self.pools[name]

    def slot_array(self, pool: str, index: int) -> np.ndarray:
        return self.pool(pool).slot(index)

    def held_bytes(self) -> dict[str, int]:
        """Bytes each tier really holds: its pool, allocated once, plus what is charged to it."""
        return {tier: self.pools[tier].nbytes + self.charged[tier] for tier in self.pools}
