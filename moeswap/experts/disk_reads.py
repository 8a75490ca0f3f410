"""Expert reads kept in flight together: the disk's queue depth, not one read at a time.

``ParallelReads`` hands each piece of an expert (gate, up or gate_up, down, biases) to a small
pool of reader threads (``preadv`` releases the GIL, so the store's thread computes meanwhile);
``depth`` pieces are read at once (``OffloadSettings.read_depth``, ``--read-depth``). An ``ExpertRead`` is one
expert's pieces; when the last lands it reports itself to the callback given at submit, so
the store computes each miss as soon as its bytes are in, in the order they land.

``DiskReader.stats.seconds`` gets the wall time during which any of these reads ran (the link
busy), so bytes over seconds stays the read rate with several reads at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from moeswap.experts.tiers import DiskReader, slot_pieces
from moeswap.models.quant_experts import ExpertLayout, ExpertPart


class ExpertRead:
    """One expert's pieces in flight; ``result()`` waits and raises the first read's error."""

    def __init__(self, n_bytes: int, n_pieces: int, on_landed: Callable[[ExpertRead], None]):
        self.n_bytes = n_bytes
        self._left, self._lock = n_pieces, threading.Lock()
        self._landed = threading.Event()
        self._futures: list[Future] = []
        self._on_landed = on_landed
        if not n_pieces:
            self._land()

    def _piece_done(self, _: Future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._land()

    def _land(self) -> None:
        self._landed.set()
        self._on_landed(self)

    def add(self, future: Future) -> None:
        self._futures.append(future)
        future.add_done_callback(self._piece_done)

    def wait(self) -> None:
        self._landed.wait()

    def result(self) -> None:
        self.wait()
        for future in self._futures:
            future.result()


class ParallelReads:
    """Up to ``depth`` piece reads at once, on threads started at the first read."""

    def __init__(self, disk: DiskReader, depth: int):
        self.disk, self.depth = disk, max(1, depth)
        self._pool: ThreadPoolExecutor | None = None
        self._running, self._since = 0, 0.0
        self._lock = threading.Lock()

    def submit(self, layout: ExpertLayout, expert: int, slot: np.ndarray,
               parts: list[ExpertPart] | None,
               on_landed: Callable[[ExpertRead], None]) -> ExpertRead:
        """Read the expert's pieces (those of ``parts``; None: all) into ``slot``."""
        pieces = [(part, target) for _, part, target in slot_pieces(layout, slot)
                  if parts is None or part in parts]
        read = ExpertRead(sum(part.expert_bytes for part, _ in pieces), len(pieces), on_landed)
        if self._pool is None and pieces:
            self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="moeswap-read")
        for part, target in pieces:
            future = self._pool.submit(self._read_piece, part, expert, target)
            read.add(future)
        return read

    def _read_piece(self, part: ExpertPart, expert: int, target: np.ndarray) -> None:
        with self._lock:
            if not self._running:
                self._since = time.perf_counter()
            self._running += 1
        try:
            self.disk.read_piece(part, expert, target)
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
                    busy = time.perf_counter() - self._since
                    with self.disk.lock:
                        self.disk.stats.seconds += busy

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
