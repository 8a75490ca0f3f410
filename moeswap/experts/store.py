"""The expert store: routed experts kept in tiers under byte budgets, behind ``run``.

Tiers, fastest first: ``device`` slots, ``host`` slots (both fixed ``SlotPool``s holding experts
in their stored, quantized form; on a CPU-only machine both are RAM and compute-ready as they
are), and ``disk`` (the model file, read with ``pread``). Each tier with slots has a cache policy
from ``moeswap.routing.policies`` (the same classes the trace simulator replays) over keys
``(layer, expert)``; the policy decides residency, the store moves bytes to match it.

For every expert a layer step needs, in ascending id order, the store:

1. uses the device slot when the device policy holds the expert (a device hit);
2. otherwise finds the bytes: a host slot (a host hit) or the file (a disk miss, read into a
   host slot when the host policy admits it, else into a staging slot);
3. asks the cost model (``MissPlanner``) whether to move the expert into a device slot
   ("transfer", when the device policy admits it) or compute it where its bytes are ("compute");
4. computes the expert at once, as a one-expert stack, on exactly the tokens that picked it.

Every product goes through ggml's ``mul_mat_id`` on the same token groups as the resident
runner, so logits are bit-identical to the fully resident model at any budget and with any
policy (docs/OFFLOAD.md). ``threshold`` (``--expert-threshold``) is an opt-in approximation:
picks with a routing weight under it are dropped and the rest rescaled, and it is counted.
``miss_lowbit`` (``--miss-lowbit``) is the other: misses no tier admits are computed from
low-bit copies held in RAM instead of read from the file (moeswap.experts.lowbit); counted.

With ``prefetch`` on, a few host slots are reserved for guesses (the host policy gets that many
fewer; between guesses they keep the policy's latest victims), and each layer step first reads
guesses for the next layers into them on a worker thread, outside the host policy until a
request uses them (moeswap.experts.guesses), and on a CUDA device tier uploads the guesses
worth moving on the copy stream; a throttle turns all of it off where it does not measurably
pay (moeswap.experts.prefetch; docs/OFFLOAD.md, "Prefetch").

Legend: N tokens, T tokens of one piece, K picks per token, D model width, F expert width,
M picks of one expert.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from moeswap.errors import MoeswapError
from moeswap.routing import policies as p
from moeswap.experts.cost import MissPlanner, Rates
from moeswap.experts.device import DEVICE_TYPES, TorchDeviceSlots, device_type_names
from moeswap.experts.lowbit import LowBitCopies
from moeswap.experts.options import kv_cache_bytes
from moeswap.experts.guesses import HostGuesses, reserved_slots
from moeswap.experts.prefetch import Prefetcher, ReadWorker
from moeswap.experts.stats import LayerStats, total
from moeswap.experts.tiers import (DiskReader, SlotPool, check_inside_file, slot_bytes,
                                   slot_pieces)
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models.quant_experts import (VECTOR_DTYPES, ExpertLayout, combine, group_picks,
                                          hidden, output, run_in_pieces)
from moeswap.quant import CpuKernels, QuantExperts
from moeswap.routing.policy_specs import live_policy



def routed_bytes(gguf: GGUFFile, layers: list[int]) -> int:
    layouts = [ExpertLayout.from_file(gguf, i) for i in layers]
    return sum(layout.expert_bytes * layout.n_experts for layout in layouts)


def shared_bytes(gguf: GGUFFile, layers: list[int]) -> int:
    """Bytes of every tensor that is not a routed expert: they stay in fast memory."""
    return sum(t.n_bytes for t in gguf.tensors) - routed_bytes(gguf, layers)


@dataclass(frozen=True)
class StoreOptions:
    host_bytes: int  # budget of the host tier; shared weights and the KV cache count in it
    device_bytes: int = 0  # budget of the device tier (0: no device slots)
    # The KV caches charged to the host budget (moeswap.experts.options.kv_cache_bytes):
    context_tokens: int = 0  # positions of each sequence
    sequences: int = 1  # sequences whose caches are held at once (a server's batch slots)
    step_tokens: int = 0  # most tokens a forward feeds one sequence (0: a whole context)
    working_bytes: int = 0  # a forward's activations, scores and logits
    # (moeswap.experts.options.forward_working_bytes)
    policy: str = "lru"
    miss: str = "auto"
    threshold: float = 0.0  # --expert-threshold: drop picks weighted under it (approximation)
    cold_reads: bool = False  # drop read bytes from the page cache (for measurements)
    rates: Rates | None = None  # None: the cost model gets the rates of a CPU-only machine
    # "ram": device slots are RAM computed by the CPU kernels (a CPU-only machine's device form);
    # a torch device ("cuda", or "cpu" to test that path): slots there, products computed there.
    device_backend: str = "ram"
    prefetch: str = "off"  # --prefetch: off, gate, history or both (moeswap.experts.prefetch)
    prefetch_depth: int = 2  # --prefetch-depth: how many MoE layers ahead to guess
    miss_lowbit: str = ""  # --miss-lowbit TYPE: serve unadmitted misses from low-bit copies


# Rates used when none are measured: a CPU-only machine, where computing in place always wins.
CPU_ONLY_RATES = Rates(disk_read=1e9, link=1e10, host_compute=1e10, device_compute=1e10)


class _Slot:
    """An expert's pieces bound in one slot: one-expert stacks and bias vectors (views)."""

    def __init__(self, kernels: CpuKernels, layout: ExpertLayout, slot: np.ndarray):
        self.matrices: dict[str, QuantExperts] = {}
        self.biases: dict[str, torch.Tensor] = {}
        for kind, part, raw in slot_pieces(layout, slot):
            if part.is_matrix:
                self.matrices[kind] = kernels.experts(raw, part.ggml_type, (*part.ne, 1), part.name)
            else:
                vector = torch.from_numpy(raw).view(VECTOR_DTYPES[part.ggml_type])
                self.biases[kind] = vector.view(-1)


class ExpertStore:
    def __init__(self, gguf: GGUFFile, kernels: CpuKernels, layers: list[int], activation: str,
                 options: StoreOptions, routers: dict | None = None):
        """routers: MoE layer -> its Router (moeswap.models.moe), which the gate prefetch
        predictor applies ahead of time; needed for ``prefetch`` gate and both."""
        self.kernels, self.activation, self.options = kernels, activation, options
        self.layouts = {i: ExpertLayout.from_file(gguf, i) for i in layers}
        check_inside_file(gguf.path, list(self.layouts.values()))
        self.slot_size = slot_bytes(list(self.layouts.values()))
        self.shared_bytes = shared_bytes(gguf, layers)
        config = config_from_gguf(gguf)
        self.kv_bytes = kv_cache_bytes(config, options.context_tokens, options.sequences,
                                       options.step_tokens)
        # Disk reads that no tier admits land in a ring of staging slots, one per pick of a token.
        self.staging = SlotPool("staging", max(config.n_expert_used, 1), self.slot_size)
        self._ring_next = 0
        # an approximation (moeswap.experts.lowbit): its copies are charged to the host budget
        self.lowbit = (LowBitCopies(gguf, self.layouts, options.miss_lowbit)
                       if options.miss_lowbit else None)
        copies = self.lowbit.nbytes if self.lowbit is not None else 0
        working = options.working_bytes
        charged = self.shared_bytes + self.kv_bytes + working + self.staging.nbytes + copies
        if options.host_bytes < charged:
            raise MoeswapError(
                f"--host-mem {options.host_bytes} bytes is below the shared weights "
                f"({self.shared_bytes} bytes) plus the KV cache ({self.kv_bytes} bytes)"
                f"{f', the working memory of a step ({working} bytes)' if working else ''} and "
                f"{self.staging.n_slots} staging slots"
                f"{f' and {copies} bytes of --miss-lowbit copies' if copies else ''}; "
                f"give at least {charged + self.slot_size} bytes")
        host_slots = (options.host_bytes - charged) // self.slot_size if self.slot_size else 0
        device_slots = options.device_bytes // self.slot_size if self.slot_size else 0
        self.budgets = {"host": options.host_bytes, "device": options.device_bytes}
        self.charged = {"host": charged, "device": 0}
        self.on_torch_device = options.device_backend != "ram"
        self.pools = {"device": self._device_pool(options.device_backend, device_slots),
                      "host": SlotPool("host", host_slots, self.slot_size)}
        # --miss-lowbit turns prefetch off: a guess or a kept victim is served at full
        # precision where prefetch off would compute the miss from its low-bit copy
        prefetching = (options.prefetch != "off" and options.prefetch_depth > 0 and host_slots
                       and not options.miss_lowbit)
        # host slots only guesses take (moeswap.experts.guesses): the host policy has fewer
        self.guess_slots = (reserved_slots(host_slots, config.n_expert_used,
                                           options.prefetch_depth) if prefetching else 0)
        self.policies: dict[str, p.CachePolicy] = {}
        for tier, pool in self.pools.items():  # device first: the host pins only what it did not
            held_faster = frozenset(key for policy in self.policies.values()
                                    for key in policy.resident())
            self.policies[tier] = live_policy(
                options.policy, pool.n_slots - (self.guess_slots if tier == "host" else 0),
                config.n_expert_used, layers,
                self.layouts[layers[0]].n_experts, str(gguf.path), held_faster)
        self.slots: dict[str, dict[tuple[int, int], int]] = {"device": {}, "host": {}}
        self.disk = DiskReader(gguf.path, cold=options.cold_reads)
        self.planner = MissPlanner(options.miss, options.rates or CPU_ONLY_RATES)
        self.layer_stats = {i: LayerStats() for i in layers}
        self._bound: dict[tuple[str, int, int], _Slot] = {}
        self.prefetch: Prefetcher | None = None
        self.guesses: HostGuesses | None = None  # prefetched, in host slots, not yet used
        self._step_keys: set[tuple[int, int]] = set()  # the experts of the running layer step
        self._to_upload: set[tuple[int, int]] = set()  # device guesses waiting for their read
        self._prefetch_on = False  # the throttle's word for the current forward
        if prefetching:
            self.prefetch = Prefetcher(options.prefetch, options.prefetch_depth, layers,
                                       routers or {}, self.layouts[layers[0]].n_experts,
                                       config.n_expert_used)
            self.worker = ReadWorker(gguf.path, options.cold_reads)
            self.guesses = HostGuesses(self.pools["host"], self.worker, self.prefetch,
                                       self.layer_stats)
            # the thread holds no reference to the store, so a dropped store stops it
            self._stop_worker = weakref.finalize(self, self.worker.close)
        for tier, policy in self.policies.items():
            for key in sorted(policy.resident()):  # pre-filled policies (a pinned hot set)
                staged = self._read_from_disk(key, self.layer_stats[key[0]])
                self._load(tier, key, self.staging.slot(staged))

    def _device_pool(self, backend: str, n_slots: int) -> SlotPool | TorchDeviceSlots:
        if backend == "ram":
            return SlotPool("device", n_slots, self.slot_size)
        odd = sorted({p.name for layout in self.layouts.values() for p in layout.matrices.values()
                      if p.ggml_type not in DEVICE_TYPES})
        if odd and n_slots:
            raise MoeswapError(f"'{odd[0]}' has a type the {backend} device tier cannot compute "
                               f"yet (it computes {device_type_names()}); leave --device-mem at 0")
        return TorchDeviceSlots(backend, n_slots, self.slot_size)

    @classmethod
    def factory(cls, options: StoreOptions):
        """What ``load_model(expert_runner=...)`` takes (moeswap.experts.factory)."""
        from moeswap.experts.factory import StoreFactory

        return StoreFactory(options)

    # -- the runner interface -------------------------------------------------------------

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], expert_ids/weights [N, K] -> [N, D]."""
        if self.prefetch is not None and self._prefetch_running(layer, x.shape[0]):
            started = time.perf_counter()
            self._prefetch_ahead(layer, x, expert_ids)
            self.prefetch.spent(time.perf_counter() - started)
        return run_in_pieces(partial(self._piece, layer), x, expert_ids, weights)

    def _piece(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], ids/weights [T, K] -> [T, D].

        Two passes over the step's experts, as the resident runner's two products: gate/up for
        all, the activation on the whole [T*K, F] tensor, then down for all. An expert evicted
        between the passes (budgets smaller than one step's experts) is fetched again.
        """
        layout, stats, top_k = self.layouts[layer], self.layer_stats[layer], ids.shape[1]
        n_picks = ids.numel()
        keep = None
        if self.options.threshold > 0:
            weights, keep = self._threshold(layout, ids, weights, stats)
        groups = [(e, picks if keep is None else picks[keep[picks]])
                  for e, picks in group_picks(ids)]
        groups = [(e, picks) for e, picks in groups if picks.numel()]
        self._step_keys = {(layer, e) for e, _ in groups}
        self.planner.start_step([(layout.expert_bytes, picks.numel()) for e, picks in groups
                                 if (layer, e) not in self.policies["device"]])
        kinds = ("gate_up",) if layout.fused else ("gate", "up")
        firsts, vectors, places = {}, {}, {}
        for expert, picks in groups:
            stats.requests += 1
            places[expert] = self._serve(layer, expert, picks.numel(), stats)
            bound = self._bound_slot(*places[expert], layer)
            rows = x[picks // top_k]  # [M, D]
            zeros = torch.zeros(rows.shape[0], 1, dtype=torch.int32)  # [M, 1]: the only expert
            for kind in kinds:
                y = bound.matrices[kind].matmul(rows, zeros)[:, 0]  # [M, F] or [M, 2F]
                firsts.setdefault(kind, x.new_zeros(n_picks, y.shape[1]))[picks] = y
            for kind, vector in bound.biases.items():
                rows_of = vectors.setdefault(kind, x.new_zeros(n_picks, vector.numel()))
                rows_of[picks] = vector.float()
        if not groups:  # every pick dropped: cannot happen, a token's top pick is always kept
            return torch.zeros_like(x)
        h = hidden(self.activation, firsts[kinds[0]], firsts.get("up"), vectors)  # [T*K, F]
        y = x.new_zeros(n_picks, x.shape[1])  # [T*K, D]
        for expert, picks in groups:
            place = self._still_held((layer, expert), places[expert], stats)
            zeros = torch.zeros(picks.numel(), 1, dtype=torch.int32)
            down = self._bound_slot(*place, layer).matrices["down"]
            y[picks] = down.matmul(h[picks], zeros)[:, 0]  # [M, D]
        return combine(output(y, vectors).view(*ids.shape, -1), weights)

    def _threshold(self, layout: ExpertLayout, ids: torch.Tensor, weights: torch.Tensor,
                   stats: LayerStats) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop picks weighted under the threshold (never a token's top pick); rescale the rest
        to the original sum. -> (weights [T, K], kept [T*K] bool)."""
        keep = weights >= self.options.threshold  # [T, K]
        keep[torch.arange(ids.shape[0]), weights.argmax(dim=1)] = True
        kept = torch.where(keep, weights, torch.zeros_like(weights))
        scaled = kept * (weights.sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True))
        dropped = int((~keep).sum())
        if dropped:
            stats.threshold_drops += dropped
            before = set(ids.flatten().tolist())
            after = set(ids[keep].tolist())
            stats.threshold_saved_bytes += len(before - after) * layout.expert_bytes
        return scaled, keep.flatten()

    # -- residency -------------------------------------------------------------------------

    def _serve(self, layer: int, expert: int, n_tokens: int, stats: LayerStats) -> tuple[str, int]:
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
        elif self.guesses is not None and key in self.guesses:
            source = ("host", self._use_guess(key, stats))
        else:
            # This step's other experts stay: evicting one would only read it again for the
            # second pass (or its own request later in the step).
            admitted = self._admit("host", key, self._step_keys - {key})
            if self.lowbit is not None and not admitted:  # the approximation fires
                stats.computed_in_place += 1
                return self.lowbit.serve(key)
            stats.disk_misses += 1
            source = ("staging", self._read_from_disk(key, stats))
            if admitted:
                if self.guesses is not None and not self.pools["host"].n_free:
                    self.guesses.make_room(self._step_keys)  # unused guesses go first
                source = ("host", self._load("host", key, self._slot_array(*source)))
        if self.pools["device"].n_slots and \
                self.planner.choose(self.layouts[layer].expert_bytes, n_tokens) == "transfer":
            step = device.access(key)
            if step.admitted:
                self._evict("device", step.evicted, stats)
                started = time.perf_counter()
                self._load("device", key, self._slot_array(*source))
                stats.stall_seconds += time.perf_counter() - started
                stats.transfers += 1
                stats.transfer_bytes += self.layouts[layer].expert_bytes
                return "device", self.slots["device"][key]
        stats.computed_in_place += 1
        return source

    def _still_held(self, key: tuple[int, int], place: tuple[str, int],
                    stats: LayerStats) -> tuple[str, int]:
        """Where the expert's bytes are for the second pass: where they were, unless evicted."""
        pool, index = place
        if self._pool(pool).holder.get(index) == key:
            return place
        stats.refetches += 1
        for tier in ("device", "host"):
            if key in self.slots[tier]:
                return tier, self.slots[tier][key]
        return "staging", self._read_from_disk(key, stats)

    def _read_from_disk(self, key: tuple[int, int], stats: LayerStats) -> int:
        """Read an expert into the next staging slot of the ring; returns that slot."""
        layout, index = self.layouts[key[0]], self._ring_next
        self._ring_next = (index + 1) % self.staging.n_slots
        self.staging.holder[index] = key
        before = self.disk.stats.seconds
        self.disk.read_expert(layout, key[1], self.staging.slot(index))
        stats.stall_seconds += self.disk.stats.seconds - before
        stats.disk_bytes += layout.expert_bytes
        return index

    def _load(self, tier: str, key: tuple[int, int], source: np.ndarray) -> int:
        """Copy an expert's bytes into a free slot of ``tier``; returns the slot."""
        pool = self.pools[tier]
        index = pool.take(key)
        if tier == "device" and self.on_torch_device:
            pool.upload(index, source)
        else:
            pool.slot(index)[:] = source
        self.slots[tier][key] = index
        return index

    def _evict(self, tier: str, key, stats: LayerStats) -> None:
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

    def _pool(self, name: str) -> SlotPool:
        if name == "lowbit":
            return self.lowbit.pool
        return self.staging if name == "staging" else self.pools[name]

    def _slot_array(self, pool: str, index: int) -> np.ndarray:
        return self._pool(pool).slot(index)

    def _bound_slot(self, pool: str, index: int, layer: int) -> _Slot:
        """The slot's bytes bound as this layer's expert layout; bound once per slot and layout."""
        layout = (self.lowbit if pool == "lowbit" else self).layouts[layer]
        if pool == "device" and self.on_torch_device:
            return self.pools["device"].expert(index, layout)
        signature = hash(tuple((q.name.split(".", 2)[2], q.ggml_type, q.ne) for q in layout.parts))
        key = (pool, index, signature)
        if key not in self._bound:
            self._bound[key] = _Slot(self.kernels, layout, self._slot_array(pool, index))
        return self._bound[key]

    # -- prefetch (moeswap.experts.prefetch): guesses read into reserved host slots on the worker
    # (moeswap.experts.guesses), and uploaded on the copy stream of a CUDA device tier --------

    def _prefetch_running(self, layer: int, n_tokens: int) -> bool:
        """The throttle decides at each forward's first MoE layer, for the whole forward."""
        if layer == next(iter(self.layouts)):
            was, self._prefetch_on = self._prefetch_on, self.prefetch.throttle.forward(n_tokens)
            stalled = sum(stats.stall_seconds for stats in self.layer_stats.values())
            self.prefetch.link.forward(n_tokens, stalled, self.disk.stats.bytes,
                                       self.disk.stats.seconds, self._prefetch_on)
            if was and not self._prefetch_on:
                self.guesses.pause()
                self._to_upload.clear()
                self.prefetch.pause()
        return self._prefetch_on

    def _prefetch_ahead(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        """Before a layer step: check the guesses made for it, drop stale reads, then give the
        next layers' guesses free host slots (or those of kept victims, then of older unused
        guesses) and hand their reads to the worker in one batch. With no such slot, nothing is
        predicted."""
        needed = {(layer, e) for e in ids.flatten().tolist()}
        self.prefetch.observe(layer, ids)
        self.guesses.collect(layer, needed)
        device_ahead = self.on_torch_device and self.pools["device"].n_slots
        if not (self.guesses.has_room(needed) or device_ahead):
            return
        pinned = set(needed)
        guesses = self.prefetch.guesses(layer, x, ids)
        for key in guesses:
            if key in self.policies["device"] or key in self.policies["host"] or \
                    key in self.guesses:
                pinned.add(key)
            elif self.guesses.queue_full() or not self.prefetch.link.allows() or \
                    not self.guesses.reserve(key, self.layouts[key[0]], pinned):
                break  # the link is busy with earlier guesses or requests, or no slot is left
            else:
                self.prefetch.link.spend(self.layouts[key[0]].expert_bytes)
                pinned.add(key)
        self.guesses.submit()
        if device_ahead:
            self._upload_ahead(layer, guesses, pinned)

    def _use_guess(self, key: tuple[int, int], stats: LayerStats) -> int:
        """A request for a guess: its slot, with its bytes (read now if its read was cancelled),
        and the host policy asked in as without prefetch -> the slot."""
        index, ready = self.guesses.take(key)
        if ready:
            stats.host_hits += 1
        else:
            stats.disk_misses += 1
            layout, before = self.layouts[key[0]], self.disk.stats.seconds
            self.disk.read_expert(layout, key[1], self.pools["host"].slot(index))
            stats.stall_seconds += self.disk.stats.seconds - before
            stats.disk_bytes += layout.expert_bytes
        if self._admit("host", key, self._step_keys - {key}):  # as a miss would be
            self.slots["host"][key] = index
        else:
            self.guesses.keep(key, index)
        return index

    def _upload_ahead(self, layer: int, guesses: list[tuple[int, int]], pinned: set) -> None:
        """Guesses the cost model would move to the device go there now, on the copy stream,
        once their host bytes are in (a read in flight: at a later step, if still ahead)."""
        self._to_upload = {k for k in self._to_upload if k[0] > layer}  # the rest is stale
        for key in [*sorted(self._to_upload), *guesses]:
            if key in self.policies["device"] or not self._worth_uploading(key[0]):
                continue
            if key in self.guesses.reads:
                self._to_upload.add(key)
                continue
            index = self.slots["host"].get(key)
            if index is None and key in self.guesses.filled:
                index = self.guesses.slots[key]
            if index is not None and self._admit("device", key, pinned):
                self._to_upload.discard(key)
                self._load("device", key, self.pools["host"].slot(index))
                self.prefetch.counts.uploads += 1
                pinned.add(key)

    def _worth_uploading(self, layer: int) -> bool:
        """Would the cost model move this layer's expert for one token?"""
        mode, rates, size = self.planner.mode, self.planner.rates, self.layouts[layer].expert_bytes
        return mode == "transfer" or (
            mode == "auto" and rates.transfer_seconds(size, 1) < rates.compute_seconds(size, 1))

    def _admit(self, tier: str, key: tuple[int, int], pinned: set) -> bool:
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
                self._evict(tier, k, self.layer_stats[k[0]])
        return key in policy

    def close(self) -> None:
        """Stop the prefetch worker (also done when the store is collected)."""
        if self.prefetch is not None:
            self._stop_worker()

    # -- accounting ------------------------------------------------------------------------

    def held_bytes(self) -> dict[str, int]:
        """Bytes each tier really holds: its pool, allocated once, plus what is charged to it."""
        return {tier: self.pools[tier].nbytes + self.charged[tier] for tier in self.pools}

    def stats(self) -> dict:
        return {
            "total": total(self.layer_stats).as_dict(),
            "layers": {i: s.as_dict() for i, s in self.layer_stats.items()},
            "tiers": {tier: {"budget_bytes": self.budgets[tier], "held_bytes": held,
                             "slots": self.pools[tier].n_slots, "slot_bytes": self.slot_size,
                             "experts_resident": len(self.slots[tier])}
                      for tier, held in self.held_bytes().items()},
            "shared_bytes": self.shared_bytes, "kv_bytes": self.kv_bytes,
            "working_bytes": self.options.working_bytes,
            **({"prefetch": self.prefetch.as_dict()} if self.prefetch is not None else {}),
            **({"lowbit": self.lowbit.as_dict()} if self.lowbit is not None else {}),
        }
