"""Guesses read in the disk's idle time (moeswap.experts.disk_reads): never while a step read
waits or runs or a step issues its reads, one chunk at a time, so a step read waits for one
chunk at most (that wait is counted); a guess the store needs is read on at the step's
priority, a stale one stops at its chunk in flight (its state says when that chunk has
landed); a reader survives any error, which surfaces where the read is used."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from moeswap.experts import disk_reads
from moeswap.experts.disk_reads import ParallelReads
from moeswap.experts.tiers import DiskReader, slot_bytes, slot_pieces
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models.quant_experts import ExpertLayout

CHUNK = 4096  # small chunks: each tiny expert is several


@pytest.fixture
def pool(mixtral_file, monkeypatch):
    """-> (reads over a logged and gateable disk, layout, log of (expert, offset in piece) read,
    gates by expert: a read of that expert waits for its event)."""
    monkeypatch.setattr(disk_reads, "CHUNK_BYTES", CHUNK)
    gguf = GGUFFile.open(mixtral_file)
    layout = ExpertLayout.from_file(gguf, config_from_gguf(gguf).moe_layers[0])
    disk = DiskReader(gguf.piece_paths)
    log, gates = [], {}
    read_piece = disk.read_piece

    def logged(part, expert, target, within=0):
        log.append((expert, within))
        if expert in gates:
            assert gates[expert].wait(60)
        read_piece(part, expert, target, within)

    disk.read_piece = logged
    reads = ParallelReads(disk, depth=2)
    yield reads, layout, log, gates
    for gate in gates.values():
        gate.set()
    reads.close()
    disk.close()


def _slot(layout) -> np.ndarray:
    return np.zeros(slot_bytes([layout]), dtype=np.uint8)


def _assert_holds(reads, layout, expert: int, slot: np.ndarray) -> None:
    expected = _slot(layout)
    for _, part, target in slot_pieces(layout, expected):
        reads.disk.read_piece(part, expert, target)
    assert np.array_equal(slot, expected)


def _until(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_guess_waits_for_the_step_and_a_step_read_for_one_chunk(pool):
    reads, layout, log, gates = pool
    reads.hold()  # a step is issuing its reads
    guess_slot = _slot(layout)
    guess = reads.guess(layout, 2, guess_slot)
    time.sleep(0.05)
    assert log == [] and guess.state == "pending" and reads.waiting == 1
    gates[2] = threading.Event()
    reads.release()
    _until(lambda: len(log) == 1)  # the guess's first chunk, held at its gate
    time.sleep(0.05)
    assert log == [(2, 0)]  # the other reader takes no second chunk of it: one at a time
    # its chunk (about CHUNK, cut on a disk block) takes 1 s to read
    reads.disk.stats.bytes, reads.disk.stats.seconds = guess.idle_chunk[1], 1.0
    step_slot = _slot(layout)
    step = reads.submit(layout, 1, step_slot, None, lambda _: None)
    charged = guess.delay_seconds  # what its held chunk had left to read at the step's arrival
    assert 0.5 < charged <= 1.0
    step.result()  # the step's pieces are read past the guess held in flight
    assert guess.read_bytes == 0 and all(expert == 1 for expert, _ in log[1:])
    reads.submit(layout, 1, _slot(layout), None, lambda _: None).result()
    assert guess.delay_seconds == charged  # each chunk charged once
    gates[2].set()
    guess.wait()
    assert guess.state == "done" and guess.read_bytes == layout.expert_bytes
    experts = [expert for expert, _ in log]
    step_reads = experts.count(1)  # after the held chunk: the step's, then the guess's rest
    assert experts == [2] + [1] * step_reads + [2] * (len(experts) - 1 - step_reads)
    _assert_holds(reads, layout, 1, step_slot)
    _assert_holds(reads, layout, 2, guess_slot)


def test_a_needed_guess_is_read_first_and_a_stale_one_stops_at_its_chunk(pool):
    reads, layout, log, gates = pool
    gates[0] = threading.Event()
    stale = reads.guess(layout, 0, _slot(layout))
    needed_slot = _slot(layout)
    needed = reads.guess(layout, 3, needed_slot)
    _until(lambda: len(log) == 1)  # the stale guess's first chunk, held
    landed = []
    needed.promote(landed.append)  # read on at the step's priority, past the held guess
    _until(lambda: landed == [needed])
    _assert_holds(reads, layout, 3, needed_slot)
    assert stale.read_bytes == 0 and stale.state == "running"
    assert reads.stop(stale) is True  # at once: it will not land
    time.sleep(0.05)
    assert stale.state == "running"  # its chunk in flight may still write into its slot
    gates[0].set()
    stale.wait()
    assert stale.state == "cancelled"
    first = disk_reads.step_chunks(layout.parts[0], 0)[0][1]  # about CHUNK, cut on a block
    assert stale.read_bytes == first < layout.expert_bytes  # no chunk after the one in flight
    assert [expert for expert, _ in log].count(0) == 1
    reads.hold()
    pending = reads.guess(layout, 1, _slot(layout))
    assert reads.cancel(pending) and pending.state == "cancelled" and reads.waiting == 0
    reads.release()
    time.sleep(0.05)
    assert [expert for expert, _ in log].count(1) == 0  # a cancelled guess is never read


@pytest.mark.parametrize("front_read_idle", [False, True])
def test_a_promoted_guess_reports_its_front_while_its_down_matrix_is_read(pool, front_read_idle):
    reads, layout, log, gates = pool
    down, opened = layout.matrices["down"], threading.Event()
    read_piece = reads.disk.read_piece
    reads.disk.read_piece = lambda part, *args: (  # the down matrix waits until opened
        part is down and _opened(opened), read_piece(part, *args))
    if not front_read_idle:
        reads.hold()  # a step is issuing its reads: nothing of the guess is read before it asks
    slot = _slot(layout)
    guess = reads.guess(layout, 2, slot)
    if front_read_idle:  # read in the idle time up to its first down chunk, held there
        _until(lambda: guess.front_left == 0 and guess.in_flight == 1)
    events = []
    guess.promote(lambda job: events.append("landed"), lambda job: events.append("front"))
    reads.release()
    _until(lambda: events == ["front"])  # the down matrix is still held
    assert guess.state == "running"
    opened.set()
    _until(lambda: events == ["front", "landed"])
    _assert_holds(reads, layout, 2, slot)


def _opened(gate: threading.Event) -> None:
    assert gate.wait(60)


def test_a_reader_survives_an_error_raised_where_the_read_is_used(pool):
    reads, layout, log, gates = pool
    read_piece = reads.disk.read_piece
    failing = iter([True])
    reads.disk.read_piece = lambda *args: (
        (_ for _ in ()).throw(ValueError("a broken read")) if next(failing, False)
        else read_piece(*args))
    with pytest.raises(ValueError, match="a broken read"):
        reads.submit(layout, 0, _slot(layout), None, lambda _: None).result()
    slot = _slot(layout)
    for _ in range(3):  # every reader still serves
        reads.submit(layout, 1, slot, None, lambda _: None).result()
    _assert_holds(reads, layout, 1, slot)
