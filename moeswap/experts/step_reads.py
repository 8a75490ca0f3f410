"""One layer step's disk reads, overlapped with its compute, each expert's bytes read once.

``Residency.serve`` decides tiers for every expert of the step before any is computed, and
starts the reads of misses a host slot admits, straight into that slot (``read_into_host``).
A miss no tier admits is only queued (place ``("queued", expert)``): it is read into the
staging ring by the store's passes. The store then walks

1. ``first_pass``: experts whose bytes are in first (hits), then each miss as its read lands,
   so the resident experts compute while the misses are read;
2. ``second_pass``: the same for the down projections.

No expert is read twice in a step. When the step's misses fit the ring, a staged expert is
read whole in the first pass and its slot kept for the second. When more misses than ring
slots come (prefill with small budgets), the ring streams: the first pass reads every piece
but the down matrix, its bias and the output scale, a slot taking the next queued expert as
soon as its expert's gate/up products are done, and the second pass reads those down pieces
the same way, while the experts held in slots compute their down products.

With device slots (``Residency.overlapped`` false) a transfer needs the bytes at once, so
serve reads synchronously as before and the passes only hand the places back.
"""

from __future__ import annotations

import queue
import time
from collections import deque

from moeswap.experts.disk_reads import ExpertRead, GuessRead
from moeswap.experts.stats import LayerStats
from moeswap.models.quant_experts import ExpertPart

Key = tuple[int, int]  # (layer, expert)
Place = tuple[str, int]  # (pool name, slot)
# What ``first_pass`` says is in of an expert it yields: all its bytes; only its front (every
# piece but the down half), the rest yielded later; that rest.
WHOLE, FRONT, REST = "whole", "front", "rest"


class StepReads:
    def __init__(self, residency):
        """residency: the moeswap.experts.residency.Residency whose slots and reads these are."""
        self.r = residency
        self.layer = -1
        self.split = False  # this step streams its staged misses through the ring
        # this step's reads into host slots, by expert: (slot, read); by expert, not by place,
        # since a slot can change hands within a step (more experts than host slots)
        self.pending: dict[Key, tuple[int, ExpertRead]] = {}
        self.unfilled: set[Key] = set()  # host slots whose read failed: read again at a hit
        # (read, only its front is in): what reads report as they land
        self._landed: queue.SimpleQueue[tuple[ExpertRead, bool]] = queue.SimpleQueue()
        self.issued = lambda: None  # called once the step's reads are issued (prefetch,
        # moeswap.experts.lookahead: guesses may read then, and the next ones are made)

    def landed(self, read: ExpertRead) -> None:
        """What a read calls when its bytes are in."""
        self._landed.put((read, False))

    def _front_landed(self, read: ExpertRead) -> None:
        self._landed.put((read, True))

    def _submit(self, key: Key, slot, parts: list[ExpertPart] | None) -> ExpertRead:
        """Read the expert's ``parts`` (None: all) into ``slot``; a whole expert's front
        (every piece but the down half) first, reported as it lands unless the step streams
        (its passes read the halves apart)."""
        on_front = None if parts is not None or self.split else self._front_landed
        return self.r.reads.submit(self.r.layouts[key[0]], key[1], slot, parts, self.landed,
                                   on_front)

    def promote(self, guess: GuessRead) -> GuessRead:
        """A guess a step asks for, read on at the step's priority; reported as a read of the
        step (its front too, unless the step streams)."""
        return guess.promote(self.landed, None if self.split else self._front_landed)

    def start(self, layer: int, experts: list[int]) -> None:
        r = self.r
        self.layer, self.pending = layer, {}
        r.step_keys = {(layer, e) for e in experts}
        misses = sum(not r.holds(key) for key in r.step_keys)
        self.split = r.overlapped and misses > r.staging.n_slots

    def read_into_host(self, key: Key, index: int, stats: LayerStats) -> None:
        """A miss admitted to host slot ``index``: its read starts (overlapped) or runs now."""
        r = self.r
        layout, slot = r.layouts[key[0]], r.pools["host"].slot(index)
        stats.disk_bytes += layout.expert_bytes
        self.unfilled.discard(key)
        if r.overlapped:
            for other, (taken, read) in list(self.pending.items()):
                if taken == index:  # evicted within the step, its read in flight: it lands first
                    read.wait()
                    del self.pending[other]
            self.pending[key] = index, self._submit(key, slot, None)
            return
        before = r.disk.stats.seconds
        r.disk.read_expert(layout, key[1], slot)
        stats.stall_seconds += r.disk.stats.seconds - before

    def first_pass(self, requests: list[tuple[int, int]], stats: LayerStats):
        """Serve each (expert, tokens picking it) -> (expert, place, what is in: WHOLE, FRONT or
        REST) for gate/up: held experts first, then misses as they land, a whole miss's front
        before its rest unless the step streams. Without overlap each is served as it is
        computed (a later miss may take a ring or device slot an earlier one used)."""
        serve = self.r.serve
        if not self.r.overlapped:
            self.issued()
            for expert, n_tokens in requests:
                stats.requests += 1
                yield expert, serve(self.layer, expert, n_tokens, stats), WHOLE
            return
        waiting: dict[ExpertRead, tuple[int, Place]] = {}
        staged = []
        places = []
        for expert, n_tokens in requests:
            stats.requests += 1
            places.append((expert, serve(self.layer, expert, n_tokens, stats)))
        self.issued()
        for expert, place in places:
            filling = self.pending.pop((self.layer, expert), None)
            if filling is not None:
                waiting[filling[1]] = expert, place
            elif place[0] == "queued":
                staged.append(expert)
            else:
                yield expert, place, WHOLE
        layout = self.r.layouts[self.layer]
        parts = layout.front if self.split else None
        yield from self._stream(waiting, staged, parts, stats)

    def second_pass(self, places: dict[int, Place], stats: LayerStats):
        """-> (expert, place) for the down products; streamed misses' down matrices as they
        land, after the experts held in slots."""
        staged = []
        for expert, place in list(places.items()):
            if self.split and place[0] == "staging":
                staged.append(expert)
            else:
                yield expert, self.r.still_held((self.layer, expert), place, stats)
        for expert, place, _ in self._stream({}, staged, self.r.layouts[self.layer].down_half,
                                             stats):
            yield expert, place

    def _stream(self, waiting: dict[ExpertRead, tuple[int, Place]], staged: list[int],
                parts: list[ExpertPart] | None, stats: LayerStats):
        """Read ``staged`` experts' ``parts`` through the ring while ``waiting`` reads land;
        yield each expert once its bytes are in (and once its front is, where reported)."""
        r, layer = self.r, self.layer
        free, queued = deque(range(r.staging.n_slots)), deque(staged)
        fronted = set()  # reads whose front was yielded
        try:
            while queued or waiting:
                while queued and free:
                    index, expert = free.popleft(), queued.popleft()
                    r.staging.holder[index] = (layer, expert)
                    read = self._submit((layer, expert), r.staging.slot(index), parts)
                    stats.disk_bytes += read.n_bytes
                    waiting[read] = expert, ("staging", index)
                started = time.perf_counter()
                read, front = self._landed.get()
                stats.stall_seconds += time.perf_counter() - started
                # not waited for: left over from a step an error cut short, or a front reported
                # after its whole read
                if read not in waiting:
                    continue
                if front:
                    fronted.add(read)
                    yield *waiting[read], FRONT
                    continue
                expert, place = waiting.pop(read)
                try:
                    read.result()
                except BaseException:
                    if place[0] == "host":
                        self.unfilled.add((layer, expert))
                    raise
                yield expert, place, REST if read in fronted else WHOLE
                if self.split and place[0] == "staging":
                    free.append(place[1])  # its products are done: the next miss may land
        finally:  # an error or an abandoned step: no read may still write into a slot
            for read in waiting:
                read.wait()

