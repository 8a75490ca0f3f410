"""Prefetched experts waiting in host slots that the host policy does not hold.

With prefetch on, ``reserved_slots`` of the host slots are kept out of the host policy (its
capacity is that much smaller; the budget is the same): there a guess always finds room once
the policy is full. A guess (moeswap.experts.prefetch) may take only a free host slot or the
slot of an older guess that no request has used; it never enters the host policy, so it never
evicts an expert that a request brought in or used, and unused guesses are the first to go when
a request's admission needs a slot. A request for a guess takes its slot and then asks the host
policy in with the same call it would make without prefetch: the host policy sees the same
requests in the same order as a policy of its capacity without prefetch, so it holds the same
experts, and a wrong guess costs at most its read and a reserved slot. The policy's victims
keep their slots here (bytes in: asked for again, a host hit) until a guess or an admission
needs one; victims go before unused reads, oldest first. So the reserve is never idle, also
while the throttle has prefetch off. A used guess the policy admits keeps its slot and its
victim joins the reserve: the reserve stays whole.

Guesses are read by the store's reader threads in the disk's idle time (moeswap.experts.
disk_reads, ``ParallelReads.guess``), each only into the slot it was given. A guess dropped
while a chunk of it is in flight has its read stopped and its slot *draining*: neither a guess's
nor free, until that chunk has landed (the store's thread does not wait for it unless a request
needs the slot and none is free); a request for a guess still
being read takes it over at the step's priority (``GuessRead.promote``), and the store computes
it when it lands, as it would a miss's read.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from moeswap.experts.disk_reads import CANCELLED, DONE, GuessRead, ParallelReads
from moeswap.experts.prefetch import Prefetcher
from moeswap.experts.stats import LayerStats
from moeswap.experts.tiers import SlotPool
from moeswap.models.quant_experts import ExpertLayout

Key = tuple[int, int]  # (layer, expert)
RESERVE_SHARE = 8  # at most one host slot in this many is kept for guesses


def reserved_slots(host_slots: int, top_k: int, depth: int) -> int:
    """Host slots only guesses take: a decode token's picks for each layer ahead, at most one
    slot in ``RESERVE_SHARE`` (none below that many slots: guesses then take free slots only)."""
    return min(top_k * depth, host_slots // RESERVE_SHARE)


class HostGuesses:
    def __init__(self, pool: SlotPool, reads: ParallelReads, prefetch: Prefetcher,
                 layer_stats: dict[int, LayerStats]):
        self.pool, self.worker, self.prefetch, self.layer_stats = pool, reads, prefetch, layer_stats
        self.slots: OrderedDict[Key, int] = OrderedDict()  # guess -> its host slot, oldest first
        self.reads: dict[Key, GuessRead] = {}  # handed to the readers, not yet collected
        self.filled: set[Key] = set()  # guesses whose slot holds their bytes
        self._unused: dict[Key, tuple[float, int, float]] = {}  # landed, not asked for yet:
        # (read seconds nobody waited for, bytes, its delay of step reads)
        self._stopped: dict[Key, GuessRead] = {}  # reads stopped with a chunk in flight, of
        # guesses whose slots are not freed yet
        self.draining: list[tuple[int, GuessRead]] = []  # (slot, its stopped read) until the
        # read's last chunk lands

    def __contains__(self, key: Key) -> bool:
        return key in self.slots

    def reading(self, key: Key) -> bool:
        """Whether the guess's read is with the readers, not collected yet."""
        return key in self.reads

    def in_flight(self, key: Key) -> bool:
        """Whether the guess's bytes are not all in yet."""
        return key in self.reads and self.reads[key].state != DONE

    def landed_slot(self, key: Key) -> int | None:
        """The slot of a guess whose bytes are in it; None for others."""
        return self.slots[key] if key in self.filled else None

    def has_room(self, keep: set) -> bool:
        """Could a guess get a slot without touching ``keep``?"""
        self._reclaim()
        return self.pool.n_free > 0 or any(k not in keep for k in self.slots)

    def queue_full(self) -> bool:
        return self.worker.waiting >= self.prefetch.queue_bound

    def reserve(self, key: Key, layout: ExpertLayout, keep: set) -> bool:
        """A slot for a new guess: a free one, else the first to go not in ``keep`` (kept
        experts, then unused reads) -> whether it got one (its read is then queued)."""
        self._reclaim()
        if not self.pool.n_free:
            victim = self._first_to_go(keep)
            if victim is None:
                return False
            self.drop(victim)
            if not self.pool.n_free:  # its read was stopped with a chunk in flight
                return False
        index = self.pool.take(key)
        self.slots[key] = index
        self.reads[key] = self.worker.guess(layout, key[1], self.pool.slot(index))
        self.prefetch.counts.reads += 1
        return True

    def collect(self, layer: int, needed: set) -> None:
        """Before ``layer`` runs: note reads that landed; stop those for this or earlier layers
        that it does not need (stale guesses: their slots are freed). Landed guesses for those
        layers were wrong: counted wasted, they stay as kept experts (the first to go; asked
        for later, a host hit)."""
        self._reclaim()
        for key, job in list(self.reads.items()):
            if job.state == DONE:
                del self.reads[key]
                self._land(key, job)
            elif key[0] <= layer and key not in needed and self._settle(key):
                self._forget(key)
        for key in [k for k in self._unused if k[0] <= layer and k not in needed]:
            self._wasted(key)

    def take(self, key: Key) -> tuple[int, bool, GuessRead | None]:
        """A request uses this guess: its slot leaves the guesses -> (slot, whether the bytes
        are in it, the read still filling it: the caller promotes it). Neither: the caller
        reads the bytes (the guess's read failed)."""
        job = self.reads.pop(key, None)
        if job is not None and job.state != DONE:
            self.prefetch.read_outcome(key[0], used=True)
            self.prefetch.counts.used += 1
            self.prefetch.counts.bytes_prefetched += job.n_bytes
            self.prefetch.hid(self.worker.disk.stats.seconds_for(self.worker.bytes_read(job)))
            return self.slots.pop(key), False, job
        if job is not None:
            self._land(key, job)
        if key in self._unused:
            hidden, _, _ = self._unused.pop(key)
            self.prefetch.read_outcome(key[0], used=True)
            self.prefetch.counts.used += 1
            self.prefetch.hid(hidden)
        ready = key in self.filled
        self.filled.discard(key)
        return self.slots.pop(key), ready, None

    def keep(self, key: Key, index: int) -> None:
        """A used guess the host policy did not admit, or the policy's victim, stays in its
        slot as a guess (first to go), bytes in: asked for again, it is a host hit."""
        self.slots[key] = index
        self.filled.add(key)

    def make_room(self, keep: set) -> None:
        """A request's admission needs a slot and none is free: a draining slot once its chunk
        lands, or the first guess to go not in ``keep`` (else the oldest) leaves; a kept
        expert or a landed guess before a read is stopped, a draining slot waited for before
        another read is stopped."""
        self._reclaim()
        victim = self._first_to_go(keep) or next(iter(self.slots), None)
        if not self.pool.n_free and victim is not None and \
                (victim not in self.reads or not self.draining):
            self.drop(victim)
        while not self.pool.n_free:  # a stopped read's chunk in flight lands first
            job = self.draining[0][1]
            started = time.perf_counter()
            self.worker.wait(job)
            waited = time.perf_counter() - started
            self.layer_stats[job.layout.layer].stall_seconds += waited
            self.prefetch.counts.wait_seconds += waited
            self.prefetch.spent(waited)
            self._reclaim()

    def _first_to_go(self, keep: set) -> Key | None:
        """Kept experts (victims, used guesses not admitted, guesses whose layer passed) before
        reads nobody used yet (they are for the layers ahead), oldest first; never one in
        ``keep``."""
        others = [k for k in self.slots if k not in keep]
        return next((k for k in others if k not in self.reads and k not in self._unused),
                    next(iter(others), None))

    def drop(self, key: Key) -> None:
        """Free an unused guess's slot, its read stopped first."""
        self._settle(key)
        if key in self._unused:
            self._wasted(key)
        self._forget(key)

    def _wasted(self, key: Key) -> None:
        """A landed guess will not be used for the layer it was read for."""
        _, wasted, delay = self._unused.pop(key)
        self.prefetch.read_outcome(key[0], used=False)
        self.prefetch.counts.bytes_wasted += wasted
        self.prefetch.delayed(delay)

    def pause(self) -> None:
        """Prefetch turns off: reads not started are dropped with their slots; a running one
        is left to land (it is settled when its slot is next taken or freed)."""
        for job in self.worker.cancel_waiting():
            key = (job.layout.layer, job.expert)
            del self.reads[key]
            self._forget(key)
            self.prefetch.counts.cancelled += 1

    def settle_all(self) -> None:
        """Let every read in flight land (tests check the slots' bytes after it)."""
        for key, job in list(self.reads.items()):
            self.worker.wait(job)
            del self.reads[key]
            self._land(key, job)
        for _, job in self.draining:
            self.worker.wait(job)
        self._reclaim()

    def _settle(self, key: Key) -> bool:
        """A guess nobody asks for now: its read stopped (what it read is wasted) -> True; or,
        if it had landed, noted as landed -> False."""
        job = self.reads.pop(key, None)
        if job is None:
            return False
        if not self.worker.stop(job):
            self._land(key, job)
            return False
        self.prefetch.counts.cancelled += 1
        if job.state == CANCELLED:
            self._count_wasted(job)
        else:  # a chunk in flight: its slot drains when freed
            self._stopped[key] = job
        return True

    def _count_wasted(self, job: GuessRead) -> None:
        """A stopped guess's read has ended: all it read, and its delay of step reads, was in
        vain."""
        self.prefetch.counts.bytes_prefetched += job.read_bytes
        self.prefetch.counts.bytes_wasted += job.read_bytes
        self.prefetch.delayed(job.delay_seconds)

    def _reclaim(self) -> None:
        """Free the draining slots whose stopped read's last chunk has landed."""
        for index, job in [d for d in self.draining if d[1].state == CANCELLED]:
            self.draining.remove((index, job))
            self._count_wasted(job)
            self.pool.release(index)

    def _land(self, key: Key, job: GuessRead) -> None:
        if job.error is not None:  # the slot stays unfilled: a request reads it (and reports)
            return
        self.prefetch.counts.bytes_prefetched += job.layout.expert_bytes
        self.filled.add(key)
        # its bytes at the store's read rate (its own wall time counts the step reads that came
        # between its chunks)
        n_bytes = job.layout.expert_bytes
        self._unused[key] = (self.worker.disk.stats.seconds_for(n_bytes), n_bytes,
                             job.delay_seconds)

    def _forget(self, key: Key) -> None:
        self.filled.discard(key)
        self._unused.pop(key, None)
        index, stopped = self.slots.pop(key), self._stopped.pop(key, None)
        if stopped is None:
            self.pool.release(index)
        else:
            self.draining.append((index, stopped))
