"""The miss path's reads: O_DIRECT with aligned bounce edges, its per-file fallback, several reads
in flight, each expert read once per step, misses computed after the step's held experts."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
import torch
from test_expert_store import decode_logits, store_model

from moeswap.errors import MoeswapError
from moeswap.experts.direct_io import BOUNCE_BYTES, DIRECT_ALIGNMENT, ModelFile
from moeswap.experts.disk_reads import CHUNK_BYTES, ParallelReads, step_chunks
from moeswap.experts.step_reads import FRONT, REST, WHOLE, StepReads
from moeswap.experts.tiers import DiskReader, slot_bytes
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models.loader import load_model
from moeswap.models.quant_experts import ExpertLayout, ExpertPart, QuantResidentExperts


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reads") / "data.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 3 * BOUNCE_BYTES + 777,
                                                       dtype=np.uint8).tobytes())
    return path


def target_at(n_bytes: int, misalign: int) -> np.ndarray:
    """A byte buffer whose address is ``misalign`` past a DIRECT_ALIGNMENT boundary."""
    spare = np.zeros(n_bytes + 2 * DIRECT_ALIGNMENT, dtype=np.uint8)
    start = -spare.ctypes.data % DIRECT_ALIGNMENT + misalign
    return spare[start:start + n_bytes]


RANGES = [(0, 4096), (1, 10), (4095, 2), (100, 2 * BOUNCE_BYTES + 5000),
          (BOUNCE_BYTES - 3, 9000), (3 * BOUNCE_BYTES, 777)]


@pytest.mark.parametrize("misalign", [0, 32, 100])
def test_cold_reads_return_the_files_bytes_at_any_offset_and_address(data_file, misalign):
    data = np.fromfile(data_file, dtype=np.uint8)
    opened = ModelFile(data_file, cold=True)
    for offset, n in RANGES:
        # congruent address and offset: the aligned middle goes straight in; else bounced
        target = target_at(n, (offset + misalign) % DIRECT_ALIGNMENT)
        opened.read(target, offset)
        assert np.array_equal(target, data[offset:offset + n]), (offset, n)
    opened.close()


def test_block_multiple_pieces_sit_on_their_file_block_and_read_straight_in(data_file,
                                                                          monkeypatch):
    from moeswap.experts.tiers import SlotPool, piece_offsets
    from moeswap.models.quant_experts import ExpertLayout, ExpertPart

    # pieces of whole blocks starting off a block, as a real model's experts do; the bias is not
    parts = {kind: ExpertPart(f"blk.0.ffn_{kind}_exps.weight", 8, (256, 32), 4, start, 8192)
             for kind, start in (("gate", 1056), ("up", 33824), ("down", 66592))}
    bias = ExpertPart("blk.0.ffn_down_exps.bias", 0, (64,), 4, 99360, 256)
    layout = ExpertLayout(0, parts, {"down": bias})
    offsets = piece_offsets(layout)
    assert [o % DIRECT_ALIGNMENT for o in offsets[:3]] == [1056, 33824 % 4096, 66592 % 4096]
    assert all(o % 32 == 0 for o in offsets)
    bounced = []
    read_bounced = ModelFile._read_bounced
    monkeypatch.setattr(ModelFile, "_read_bounced", lambda self, target, offset: (
        bounced.append(target.nbytes), read_bounced(self, target, offset)))
    pool = SlotPool("host", 2, slot_bytes([layout]))
    disk = DiskReader([data_file], cold=True)
    disk.read_expert(layout, 3, pool.slot(1))
    data = np.fromfile(data_file, dtype=np.uint8)
    for part, offset in zip(layout.parts, offsets):
        start = part.data_start + 3 * part.expert_bytes
        assert np.array_equal(pool.slot(1)[offset:offset + part.expert_bytes],
                              data[start:start + part.expert_bytes])
    if disk.files[0].direct:  # (a filesystem refusing O_DIRECT reads them all cached)
        assert bounced and max(bounced) < DIRECT_ALIGNMENT  # only the pieces' edges bounced
    disk.close()


def test_a_filesystem_refusing_o_direct_falls_back_to_dropped_preads(data_file, monkeypatch):
    real_open, dropped = os.open, []

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, at, n, advice: dropped.append((at, n)))
    opened = ModelFile(data_file, cold=True)
    assert not opened.direct
    target = target_at(5000, 7)
    opened.read(target, 123)
    assert np.array_equal(target, np.fromfile(data_file, dtype=np.uint8)[123:5123])
    assert dropped == [(123, 5000)]
    opened.close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_o_direct_refused_at_the_first_read_switches_that_file_to_preads(data_file, monkeypatch):
    opened = ModelFile(data_file, cold=True)
    if not opened.direct:  # this filesystem refused it at open: the test above covers that
        opened.close()
        return
    real_preadv, refused_fd = os.preadv, opened.direct_fd

    def refuse(fd, buffers, offset):
        if fd == refused_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse)
    target = target_at(9000, 0)
    opened.read(target, 4096)
    assert not opened.direct
    assert np.array_equal(target, np.fromfile(data_file, dtype=np.uint8)[4096:13096])
    opened.close()


def test_reads_run_depth_at_once_and_land_in_their_slots(mixtral_file):
    gguf = GGUFFile.open(mixtral_file)
    layout = ExpertLayout.from_file(gguf, config_from_gguf(gguf).moe_layers[0])
    disk = DiskReader(gguf.piece_paths, cold=True)
    reads = ParallelReads(disk, depth=3)
    together = threading.Barrier(3, timeout=60)  # passes only with three reads running at once
    read_piece = disk.read_piece
    disk.read_piece = lambda *args: (together.wait(), read_piece(*args))
    size = slot_bytes([layout])
    slots = [np.zeros(size, dtype=np.uint8) for _ in range(layout.n_experts)]
    submitted = [reads.submit(layout, expert, slots[expert], None, lambda _: None)
                 for expert in range(3)]  # 3 experts x 3 pieces: three rounds of three at once
    for read in submitted:
        read.result()
    reference = DiskReader(gguf.piece_paths)
    for expert in range(3):
        expected = np.zeros(size, dtype=np.uint8)
        reference.read_expert(layout, expert, expected)
        assert np.array_equal(slots[expert], expected)
    assert disk.stats.reads == 9 and disk.stats.bytes == 3 * layout.expert_bytes
    reads.close()
    reference.close()
    disk.close()


@pytest.mark.parametrize("size", [100, 4096, CHUNK_BYTES, 3 * CHUNK_BYTES + 12345])
@pytest.mark.parametrize("start", [0, 777])
def test_step_chunks_cover_a_piece_cut_on_disk_blocks(size, start):
    part = ExpertPart("blk.0.ffn_down_exps.weight", 8, (size, 1), 4, start, size)
    for expert in range(4):
        chunks = step_chunks(part, expert)
        first = start + expert * size
        assert [at for at, _ in chunks] == [0] + [at + n for at, n in chunks[:-1]]
        assert sum(n for _, n in chunks) == size and all(n > 0 for _, n in chunks)
        assert all((first + at) % DIRECT_ALIGNMENT == 0 for at, _ in chunks[1:])
        assert len(chunks) == max(1, round(size / CHUNK_BYTES))


def test_an_experts_front_lands_first_and_is_reported_before_the_rest(mixtral_file):
    gguf = GGUFFile.open(mixtral_file)
    layout = ExpertLayout.from_file(gguf, config_from_gguf(gguf).moe_layers[0])
    disk = DiskReader(gguf.piece_paths, cold=True)
    reads = ParallelReads(disk, depth=1)  # one reader: chunks in the order they are queued
    order, events = [], []
    read_piece = disk.read_piece
    disk.read_piece = lambda part, *args: (order.append(part.name), read_piece(part, *args))
    down = layout.matrices["down"]
    front = [part for part in layout.parts if part is not down]
    slot = np.zeros(slot_bytes([layout]), np.uint8)
    assert front == layout.front
    read = reads.submit(layout, 2, slot, None, lambda r: events.append(("landed", len(order))),
                        lambda r: events.append(("front", len(order))))
    read.result()
    # every front piece before the down matrix; the front reported before the down was read
    assert set(order[:len(front)]) == {part.name for part in front}
    assert order[len(front):] == [down.name]
    assert events == [("front", len(front)), ("landed", len(order))]
    expected = np.zeros_like(slot)
    DiskReader(gguf.piece_paths).read_expert(layout, 2, expected)
    assert np.array_equal(slot, expected)
    reads.close()
    disk.close()


def test_a_front_that_failed_is_not_reported_and_the_read_raises(mixtral_file):
    gguf = GGUFFile.open(mixtral_file)
    layout = ExpertLayout.from_file(gguf, config_from_gguf(gguf).moe_layers[0])
    disk = DiskReader(gguf.piece_paths, cold=True)
    reads = ParallelReads(disk, depth=1)
    down = layout.matrices["down"]

    def fail_gate(part, *args):
        if part is not down:
            raise OSError(errno.EIO, "Input/output error")

    disk.read_piece = fail_gate
    fronts = []
    read = reads.submit(layout, 0, np.zeros(slot_bytes([layout]), np.uint8), None,
                        lambda r: None, fronts.append)
    with pytest.raises(OSError, match="Input/output error"):
        read.result()
    assert fronts == []
    reads.close()


def test_a_miss_computed_in_halves_as_its_front_lands_keeps_the_logits_exact(mixtral_file,
                                                                             monkeypatch):
    resident = load_model(mixtral_file, threads=1, expert_runner=QuantResidentExperts)
    expected = decode_logits(resident)
    stages = []
    first_pass = StepReads.first_pass

    def noted(self, *args):
        for served in first_pass(self, *args):
            stages.append(served[2])
            yield served

    monkeypatch.setattr(StepReads, "first_pass", noted)
    # one reader: a miss's down matrix is read after its front, which is reported first
    model, factory = store_model(mixtral_file, 4, cold_reads=True, prefetch="off", read_depth=1)
    assert torch.equal(decode_logits(model), expected)
    assert factory.stats()["total"]["disk_misses"] > 0
    assert 0 < stages.count(FRONT) == stages.count(REST)


def test_a_short_read_in_flight_names_the_file_and_tensor(mixtral_file, tmp_path):
    gguf = GGUFFile.open(mixtral_file)
    last = max((t for t in gguf.tensors if "_exps" in t.name), key=lambda t: t.data_end)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(mixtral_file.read_bytes()[:last.data_start + last.n_bytes // 2])
    layout = ExpertLayout.from_file(gguf, int(last.name.split(".")[1]))
    reads = ParallelReads(DiskReader([cut], cold=True), depth=2)
    read = reads.submit(layout, layout.n_experts - 1, np.zeros(slot_bytes([layout]), np.uint8),
                        None, lambda _: None)
    with pytest.raises(MoeswapError, match=rf"^{cut}: the file ends before bytes \d+-\d+ of "
                                           rf"tensor '{last.name}'; it is truncated"):
        read.result()
    reads.close()


@pytest.mark.parametrize("host_slots", [0, 3])
def test_no_piece_is_read_twice_in_a_step_and_logits_stay_exact(mixtral_file, host_slots):
    resident = load_model(mixtral_file, threads=1, expert_runner=QuantResidentExperts)
    expected = decode_logits(resident)
    model, factory = store_model(mixtral_file, host_slots, cold_reads=True, prefetch="off")
    r = factory.store.residency
    seen, twice, steps, reads = set(), [], [], []
    read_piece, start = r.disk.read_piece, r.step.start

    def counted(part, expert, target, within=0):
        reads.append(target.nbytes)
        chunk = (part.name, expert, within)
        twice.extend([chunk] if chunk in seen else [])
        seen.add(chunk)
        read_piece(part, expert, target, within)

    def new_step(layer, experts):
        seen.clear()
        steps.append(len(experts) > r.staging.n_slots)
        start(layer, experts)

    r.disk.read_piece, r.step.start = counted, new_step
    assert torch.equal(decode_logits(model), expected)
    assert not twice
    assert any(steps)  # the prefill had more misses than ring slots: streamed
    stats = factory.stats()
    total, disk = stats["total"], stats["disk"]
    assert total["refetches"] == 0 and total["disk_misses"] > 0
    # the reader's own record: every piece once, and a busy time the reads took
    assert disk["reads"] == len(reads) and disk["bytes"] == sum(reads) == total["disk_bytes"]
    assert disk["busy_seconds"] > 0


def test_held_experts_compute_while_the_steps_misses_are_read(mixtral_file):
    model, factory = store_model(mixtral_file, 3, cold_reads=True, prefetch="off")
    decode_logits(model)  # fills the host slots: 3 of 8 experts, so some layer holds some, not all
    r = factory.store.residency
    layer = next(i for i in r.layouts if 0 < sum(k[0] == i for k in r.slots["host"]) < 4)
    held = sorted(e for (i, e) in r.slots["host"] if i == layer)
    missing = sorted(set(range(r.layouts[layer].n_experts)) - set(held))
    release = threading.Event()
    read_piece = r.disk.read_piece
    r.disk.read_piece = lambda *args: (release.wait(60), read_piece(*args))
    r.step.start(layer, [held[0], missing[0]])
    stats = r.layer_stats[layer]
    passes = r.step.first_pass([(missing[0], 1), (held[0], 1)], stats)
    first = next(passes)
    assert first == (held[0], ("host", r.slots["host"][layer, held[0]]), WHOLE)  # its read waits
    release.set()
    # the miss whole, or its front then the rest (which lands first is up to the readers)
    rest = [(e, place, stage) for e, place, stage in passes if stage != FRONT]
    assert [(e, stage) for e, _, stage in rest] in ([(missing[0], WHOLE)], [(missing[0], REST)])
    down = r.step.second_pass({e: place for e, place, _ in [first, *rest]}, stats)
    assert sorted(e for e, _ in down) == sorted([held[0], missing[0]])
