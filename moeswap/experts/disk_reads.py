"""Expert reads kept in flight together: the step's own reads first, guesses in the idle time.

``ParallelReads`` runs ``depth`` reader threads (``OffloadSettings.read_depth``,
``--read-depth``; ``preadv`` releases the GIL, so the store's thread computes meanwhile). Two
kinds of work share them:

- **the step's reads** (``submit``): an expert's pieces (gate, up or gate_up, down, biases) cut
  into chunks of about ``CHUNK_BYTES``, first come first served, ``depth`` at once, its
  front's chunks (gate/up) before the rest. An ``ExpertRead`` is one expert's chunks; when its
  front is in it reports that (the store computes the activation while the down matrix is read),
  and when the last chunk lands it reports itself, so the store finishes each miss as soon as its
  bytes are in, in the order they land.
- **guesses** (``guess``): experts the prefetcher (moeswap.experts.prefetch) expects a later
  layer to ask for, read in the same chunks, front first, one chunk at a time, and only while
  no step read waits or runs and no step is issuing its reads (``hold``): they fill the disk's
  idle time between a layer's last read and the next layer's routing, when nothing else could
  be read. A step read that arrives meanwhile waits at most for the one chunk in flight. A
  guess the store asks for (``GuessRead.promote``) is read on at the step's priority, every
  reader at once, and reports its front as a step read does; a stale one is stopped at its
  next chunk (``stop``, which does not wait for the chunk in flight: the slot's owner frees the
  slot once the guess is cancelled).

``DiskReader.stats.seconds`` gets the wall time during which any of these reads ran (the link
busy), so bytes over seconds stays the read rate with several reads at once. A guess's
``delay_seconds`` is what it may cost the step's reads: what its chunk in flight at a step
read's arrival had left to read, at the measured read rate (the prefetch throttle weighs it
where the guess was not used).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from moeswap.experts.direct_io import DIRECT_ALIGNMENT
from moeswap.experts.tiers import DiskReader, slot_pieces
from moeswap.models.quant_experts import ExpertLayout, ExpertPart

# The read unit: an expert's piece is read as chunks of about this size, taken in order by every
# reader, so that an expert's front (gate/up) lands while the rest is read; a guess's chunk is
# also what a step read may have to wait for (~1 ms at 2 GB/s). On the VM of session 12, step
# reads of 1 MiB ran slower than whole pieces, 2-3 MiB as fast; guesses in 4 MiB chunks had
# reached 81-90 % of the floor against 81-84 % in 1 MiB (docs/BENCHMARKS.md, issue 19).
CHUNK_BYTES = 2 << 20

PENDING, RUNNING, DONE, CANCELLED = "pending", "running", "done", "cancelled"


def step_chunks(part: ExpertPart, expert: int) -> list[tuple[int, int]]:
    """(offset in the piece, bytes) of the expert's piece's chunks: about CHUNK_BYTES each,
    cut where the file offset is a whole disk block (a cold read's aligned middle)."""
    return _chunks(part.data_start + expert * part.expert_bytes, part.expert_bytes, CHUNK_BYTES)


@functools.lru_cache(maxsize=1 << 16)
def _chunks(start: int, size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Shared: never written to."""
    n = max(1, round(size / chunk_bytes))
    cuts = sorted({0, size, *(_block(start + size * i // n) - start for i in range(1, n))})
    cuts = [c for c in cuts if 0 <= c <= size]
    return [(a, b - a) for a, b in zip(cuts, cuts[1:])]


def _front_first(layout: ExpertLayout, expert: int, slot: np.ndarray,
                 parts: list[ExpertPart] | None = None) -> list[tuple]:
    """(piece, target chunk, offset in the piece, of the front) for the expert's pieces (those
    of ``parts``; None: all) held in ``slot``, the front's chunks first."""
    pieces = [(part, target, any(part is f for f in layout.front))  # identity: cheap
              for _, part, target in slot_pieces(layout, slot)
              if parts is None or any(part is p for p in parts)]
    return [(part, target[at:at + n], at, ahead)
            for ahead in (True, False) for part, target, mine in pieces if mine == ahead
            for at, n in step_chunks(part, expert)]


def _block(offset: int) -> int:
    return offset - offset % DIRECT_ALIGNMENT


class ExpertRead:
    """One expert's chunks in flight; ``result()`` waits and raises the first read's error.
    ``on_landed(self)`` once every chunk is in; ``on_front(self)``, where given, once the chunks of
    its front are in without error (not when they end up the last: then only ``on_landed``)."""

    def __init__(self, n_bytes: int, n_chunks: int, on_landed: Callable[[ExpertRead], None],
                 n_front: int = 0, on_front: Callable[[ExpertRead], None] | None = None):
        self.n_bytes = n_bytes
        self._left, self._front_left, self._lock = n_chunks, n_front, threading.Lock()
        self._landed = threading.Event()
        self._error: BaseException | None = None
        self._on_landed, self._on_front = on_landed, on_front
        if not n_chunks:
            self._land()

    def chunk_done(self, error: BaseException | None, front: bool) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
            self._error = self._error or error
            if front:
                self._front_left -= 1
            front_in = (front and not self._front_left and not last and self._error is None
                        and self._on_front is not None)
        if front_in:
            self._on_front(self)
        if last:
            self._land()

    def _land(self) -> None:
        self._landed.set()
        self._on_landed(self)

    def wait(self) -> None:
        self._landed.wait()

    def result(self) -> None:
        self.wait()
        if self._error is not None:
            raise self._error


class GuessRead:
    """A guessed expert read chunk by chunk into its slot. ``state`` is pending (no chunk
    started), running, done or cancelled."""

    def __init__(self, pool: ParallelReads, layout: ExpertLayout, expert: int,
                 target: np.ndarray):
        self._pool, self.layout, self.expert = pool, layout, expert
        self.n_bytes = layout.expert_bytes
        # (piece, target chunk, offset in the piece, of the front), the front's first
        self.chunks: deque[tuple[ExpertPart, np.ndarray, int, bool]] = deque(
            _front_first(layout, expert, target))
        self.front_left = sum(chunk[3] for chunk in self.chunks)  # front chunks not landed
        self.state, self.in_flight = PENDING, 0
        self.urgent = False  # asked for: read at the step's priority
        self.stopping = False  # stopped: the chunks in flight end it, cancelled
        self.error: BaseException | None = None
        self.read_bytes = 0  # chunks read so far (a stopped guess's wasted bytes)
        self.delay_seconds = 0.0  # what its chunks had left to read when step reads came
        self.idle_chunk: tuple[float, int] | None = None  # (start, bytes) of its chunk in
        # flight read in the idle time (one at a time)
        self._on_landed: Callable[[GuessRead], None] | None = None
        self._on_front: Callable[[GuessRead], None] | None = None

    def promote(self, on_landed: Callable[[GuessRead], None],
                on_front: Callable[[GuessRead], None] | None = None) -> GuessRead:
        """The store needs it: the rest is read at the step's priority; ``on_landed(self)`` once
        it is in (at once if it is), and ``on_front(self)`` where given once its front is while
        the rest is still read (at once if the front is in already)."""
        self._pool.promote(self, on_landed, on_front)
        return self

    def wait(self) -> None:
        self._pool.wait(self)

    def result(self) -> None:
        self.wait()
        if self.error is not None:
            raise self.error


class ParallelReads:
    """``depth`` reader threads, started at the first read: the step's reads, then guesses."""

    def __init__(self, disk: DiskReader, depth: int):
        self.disk, self.depth = disk, max(1, depth)
        self._cv = threading.Condition()
        # chunks: (piece, expert, target, offset in the piece, its expert's read, of its front)
        self._steps: deque[tuple[ExpertPart, int, np.ndarray, int, ExpertRead, bool]] = deque()
        self._guesses: deque[GuessRead] = deque()  # not finished, in submission order
        self._threads: list[threading.Thread] = []
        self._step_running = 0  # step pieces being read
        self._running, self._since = 0, 0.0  # any read; since when the link is busy
        self._held = False
        self._stopping = False
        self._idle_chunks: set[GuessRead] = set()  # guesses with a chunk in flight read in
        # the idle time, not yet charged to a step read
        self._chunk_bytes, self._chunk_seconds = 0, 0.0  # idle chunks read: the rate of a
        # single read, which the step's several reads at once beat

    # the step's reads

    def submit(self, layout: ExpertLayout, expert: int, slot: np.ndarray,
               parts: list[ExpertPart] | None, on_landed: Callable[[ExpertRead], None],
               on_front: Callable[[ExpertRead], None] | None = None) -> ExpertRead:
        """Read the expert's pieces (those of ``parts``; None: all) into ``slot``, in chunks of
        about CHUNK_BYTES taken in order, its front's (``layout.front``) first: with
        ``on_front``, the front is reported as it lands while the rest is read."""
        chunks = _front_first(layout, expert, slot, parts)
        read = ExpertRead(sum(chunk[1].nbytes for chunk in chunks), len(chunks), on_landed,
                          sum(chunk[3] for chunk in chunks), on_front)
        with self._cv:
            self._start_threads()
            self._steps.extend((part, expert, target, at, read, ahead)
                               for part, target, at, ahead in chunks)
            self._charge_idle_chunks()
            self._cv.notify_all()
        return read

    def step_reads_in_flight(self) -> bool:
        """Whether a step's read waits or runs."""
        with self._cv:
            return bool(self._steps or self._step_running)

    def hold(self) -> None:
        """A step is issuing its reads: no guess chunk starts until ``release``."""
        with self._cv:
            self._held = True

    def release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    # guesses

    def guess(self, layout: ExpertLayout, expert: int, slot: np.ndarray) -> GuessRead:
        """Read a guessed expert into ``slot`` in the disk's idle time."""
        job = GuessRead(self, layout, expert, slot)
        with self._cv:
            self._start_threads()
            self._guesses.append(job)
            if not self._held:  # held: ``release`` wakes the readers
                self._cv.notify()
        return job

    @property
    def waiting(self) -> int:
        """Guesses no chunk of which has started."""
        with self._cv:
            return sum(job.state == PENDING for job in self._guesses)

    def cancel(self, job: GuessRead) -> bool:
        """Drop a guess no chunk of which has started -> True; False once one has."""
        with self._cv:
            if job.state != PENDING:
                return False
            self._finish(job, CANCELLED)
            return True

    def cancel_waiting(self) -> list[GuessRead]:
        """Drop every guess no chunk of which has started -> those guesses."""
        with self._cv:
            dropped = [job for job in self._guesses if job.state == PENDING]
            for job in dropped:
                self._finish(job, CANCELLED)
            return dropped

    def stop(self, job: GuessRead) -> bool:
        """A guess nobody will ask for: its chunks not started are dropped -> True, it will not
        land (cancelled now, or when its chunks in flight end: until ``job.state`` says
        cancelled they may still write into its slot); False if it was done."""
        with self._cv:
            if job.state in (DONE, CANCELLED):
                return job.state == CANCELLED
            job.chunks.clear()
            job.stopping = True
            if not job.in_flight:
                self._finish(job, CANCELLED)
            return True

    def promote(self, job: GuessRead, on_landed: Callable[[GuessRead], None],
                on_front: Callable[[GuessRead], None] | None) -> None:
        with self._cv:
            if job.state == CANCELLED:
                raise ValueError("a cancelled guess cannot be promoted")
            job.urgent = True
            done = job.state == DONE
            if not done:  # its last chunk reports it
                job._on_landed, job._on_front = on_landed, on_front
                front_in = not job.front_left and job.error is None and on_front is not None
                self._cv.notify_all()
        if done:
            on_landed(job)
        elif front_in:
            on_front(job)

    def wait(self, job: GuessRead) -> None:
        """Block until a guess is done (read at the step's priority meanwhile)."""
        with self._cv:
            if job.state not in (DONE, CANCELLED):
                job.urgent = True
                self._cv.notify_all()
            while job.state not in (DONE, CANCELLED):
                self._cv.wait()

    # the readers

    def _start_threads(self) -> None:
        if not self._threads:
            for i in range(self.depth):
                thread = threading.Thread(target=self._loop, name=f"moeswap-read-{i}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)

    def _next(self):
        """Under the lock: the next task, by priority -> ("step", piece) or ("guess", job,
        chunk); None when closing."""
        while True:
            if self._steps:  # read even while closing: the store waits for them
                return "step", self._steps.popleft()
            urgent = next((j for j in self._guesses if j.urgent and j.chunks), None)
            if urgent is not None:
                return "guess", urgent, urgent.chunks.popleft()
            if self._stopping:
                return None
            idle = not (self._held or self._step_running
                        or any(j.in_flight for j in self._guesses))
            job = next((j for j in self._guesses if j.chunks), None) if idle else None
            if job is not None:
                return "guess", job, job.chunks.popleft()
            self._cv.wait()

    def _loop(self) -> None:
        while True:
            with self._cv:
                task = self._next()
                if task is None:
                    return
                self._began_read()
                if task[0] == "step":
                    self._step_running += 1
                else:
                    job, idle = task[1], not task[1].urgent
                    job.in_flight += 1
                    if idle:
                        job.idle_chunk = time.perf_counter(), task[2][1].nbytes
                        self._idle_chunks.add(job)
                    if job.state == PENDING:
                        job.state = RUNNING
            if task[0] == "step":
                part, expert, target, at, read, in_front = task[1]
                error = self._read(part, expert, target, at)
                with self._cv:
                    self._step_running -= 1
                    self._ended_read()
                read.chunk_done(error, in_front)
            else:
                _, job, (part, target, at, in_front) = task
                self._guess_chunk_done(job, target.nbytes, self._read_chunk(job, part, target, at),
                                       idle, in_front)

    def _read_chunk(self, job: GuessRead, part: ExpertPart, target: np.ndarray,
                    within: int) -> BaseException | None:
        return self._read(part, job.expert, target, within)

    def _read(self, part: ExpertPart, expert: int, target: np.ndarray,
              within: int) -> BaseException | None:
        try:
            self.disk.read_piece(part, expert, target, within)
        except Exception as e:  # raised in the store's thread, where the read is used
            return e
        return None

    def _guess_chunk_done(self, job: GuessRead, n_bytes: int, error: BaseException | None,
                          idle: bool, in_front: bool) -> None:
        """``idle``: the chunk was read in the idle time (nobody had asked for its guess);
        ``in_front``: it was one of its front's."""
        landed = front = None
        with self._cv:
            job.in_flight -= 1
            job.front_left -= in_front
            if idle:
                self._idle_chunks.discard(job)
                self._chunk_bytes += n_bytes
                self._chunk_seconds += time.perf_counter() - job.idle_chunk[0]
                job.idle_chunk = None
            job.read_bytes += n_bytes
            self._ended_read()
            if error is not None and job.error is None:
                job.error = error
                job.chunks.clear()  # the rest is of no use: the store reads it again
            if not job.chunks and not job.in_flight and job.state == RUNNING:
                if job.stopping:
                    self._finish(job, CANCELLED)
                else:
                    landed = job._on_landed
                    self._finish(job, DONE)
            elif in_front and not job.front_left and job.error is None:
                front = job._on_front  # the rest still to read
            self._cv.notify_all()
        if front is not None:
            front(job)
        if landed is not None:
            landed(job)

    def _charge_idle_chunks(self) -> None:
        """Under the lock, a step read arriving: the bytes the idle chunks in flight have left
        to read delay it (the disk reads them first or beside it), charged to their guesses
        once, at the store's measured read rate."""
        stats = self.disk.stats
        if not stats.bytes:
            return
        for job in self._idle_chunks:
            left = job.idle_chunk[1] - self._chunk_progress(job)
            job.delay_seconds += stats.seconds_for(left)
        self._idle_chunks.clear()

    def _chunk_progress(self, job: GuessRead) -> int:
        """Under the lock: bytes of its idle chunk in flight read by now, at the rate idle
        chunks have been read."""
        if job.idle_chunk is None:
            return 0
        started, n_bytes = job.idle_chunk
        rate = self._chunk_bytes / self._chunk_seconds if self._chunk_seconds else 0.0
        return min(n_bytes, int((time.perf_counter() - started) * rate))

    def bytes_read(self, job: GuessRead) -> int:
        """A guess's bytes read by now: its chunks landed and, estimated, its chunk in flight."""
        with self._cv:
            return job.read_bytes + self._chunk_progress(job)

    def _finish(self, job: GuessRead, state: str) -> None:
        """Under the lock."""
        job.state = state
        job.chunks.clear()
        self._guesses.remove(job)
        self._cv.notify_all()

    def _began_read(self) -> None:
        """Under the lock: the link's busy time starts with the first read in flight."""
        if not self._running:
            self._since = time.perf_counter()
        self._running += 1

    def _ended_read(self) -> None:
        self._running -= 1
        if not self._running:
            with self.disk.lock:
                self.disk.stats.seconds += time.perf_counter() - self._since

    def close(self) -> None:
        """Drop guesses not started, let every read in flight end, stop the threads."""
        with self._cv:
            self._stopping = True
            for job in list(self._guesses):
                if not job.urgent:  # one the store waits for is read to its end
                    job.chunks.clear()
                    job.stopping = True
                    if not job.in_flight:
                        self._finish(job, CANCELLED)
            self._cv.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self._threads = []
        with self._cv:
            self._stopping = False
