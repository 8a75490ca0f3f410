"""Where an expert's bytes can be: a slot of a fixed pool in RAM, or the model file on disk.

A ``SlotPool`` is one buffer allocated once and cut into equal slots, each able to hold any
expert of the model in its stored (quantized) form: all of its pieces (gate and up or fused
gate_up, down, biases) at 32-byte-aligned offsets, which ggml requires of weights (and, for
pieces of whole disk blocks, at their file offset modulo a block: ``piece_offsets``). Pools
never grow or shrink, so there is no allocator churn per token and no fragmentation.

``DiskReader`` reads an expert's pieces from the model file into a slot; for a split set, from
whichever file of the set holds each piece (each file opened at its first read).
With ``cold=True`` its reads bypass the page cache (``O_DIRECT``, else ``pread`` and
``posix_fadvise DONTNEED``: moeswap.experts.direct_io), so that disk reads are disk reads and
not RAM copies, and a memory cgroup is not charged page cache that budgets never count.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from moeswap.errors import MoeswapError
from moeswap.experts.direct_io import DIRECT_ALIGNMENT, ModelFile, ShortRead
from moeswap.models.quant_experts import ExpertLayout, ExpertPart

ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def piece_offsets(layout: ExpertLayout) -> list[int]:
    """Offsets of the layout's pieces (``layout.parts`` order) inside a slot, 32-byte aligned.
    Where every expert's piece starts at the same file offset modulo a disk block (its bytes a
    whole number of blocks, as in real models' experts), the piece is placed at that offset
    modulo the block too: slots start on a block, so a cold read's aligned middle goes
    straight into the slot (moeswap.experts.direct_io)."""
    offsets, at = [], 0
    for part in layout.parts:
        if part.expert_bytes % DIRECT_ALIGNMENT == 0 and part.data_start % ALIGNMENT == 0:
            at += (part.data_start - at) % DIRECT_ALIGNMENT  # [0, 4096), a multiple of 32
        offsets.append(at)
        at += _aligned(part.expert_bytes)
    return offsets


def slot_pieces(layout: ExpertLayout, slot):
    """(kind, part, bytes) of each piece of an expert held in ``slot`` (a numpy or torch byte
    buffer), kinds named as in ``layout.matrices`` and ``layout.biases``."""
    kinds = [*layout.matrices, *layout.biases]  # the order of layout.parts
    for kind, part, offset in zip(kinds, layout.parts, piece_offsets(layout)):
        yield kind, part, slot[offset:offset + part.expert_bytes]


def slot_bytes(layouts: list[ExpertLayout]) -> int:
    """A slot big enough for the largest expert of any layer, pieces placed as
    ``piece_offsets`` places them; whole disk blocks, so that every slot starts on one."""
    ends = [offset + _aligned(part.expert_bytes) for layout in layouts
            for part, offset in zip(layout.parts, piece_offsets(layout))]
    return -(-max(ends, default=0) // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT


class FreeSlots:
    """Which slot of a fixed pool holds which expert; a freed slot is the next one taken."""

    def __init__(self, n_slots: int):
        self._free = list(range(n_slots - 1, -1, -1))
        self.holder: dict[int, object] = {}  # slot -> key of the expert it holds

    def take(self, key) -> int:
        index = self._free.pop()
        self.holder[index] = key
        return index

    def release(self, index: int) -> None:
        del self.holder[index]
        self._free.append(index)

    @property
    def n_free(self) -> int:
        return len(self._free)


class SlotPool(FreeSlots):
    """``n_slots`` slots of ``slot_size`` bytes in one buffer, allocated once."""

    def __init__(self, name: str, n_slots: int, slot_size: int):
        super().__init__(n_slots)
        self.name = name
        self.n_slots, self.slot_size = n_slots, slot_size
        # on a disk block: cold reads land straight in slots (moeswap.experts.direct_io)
        spare = np.empty(n_slots * slot_size + DIRECT_ALIGNMENT, dtype=np.uint8)
        start = -spare.ctypes.data % DIRECT_ALIGNMENT
        self.buffer = spare[start:start + n_slots * slot_size]  # [n_slots * slot_size]

    @property
    def nbytes(self) -> int:
        """Bytes this pool holds (its whole buffer, used or not)."""
        return self.buffer.nbytes

    def slot(self, index: int) -> np.ndarray:
        return self.buffer[index * self.slot_size:(index + 1) * self.slot_size]


@dataclass
class ReadStats:
    bytes: int = 0
    seconds: float = 0.0
    reads: int = 0  # pieces read

    def seconds_for(self, n_bytes: int) -> float:
        """How long ``n_bytes`` take at the rate read so far (0 before any read)."""
        return n_bytes * self.seconds / self.bytes if self.bytes else 0.0


Paths = list[str | os.PathLike]  # the model's files: one, or a split set's pieces in order


def truncated(path: str | os.PathLike, part: ExpertPart, start: int, end: int) -> MoeswapError:
    return MoeswapError(f"{path}: the file ends before bytes {start}-{end} of tensor "
                        f"'{part.name}'; it is truncated: download or convert it again")


def check_inside_file(paths: Paths, layouts: list[ExpertLayout]) -> None:
    """Every expert piece's data must lie inside its file (a truncated download otherwise
    fails at the first read of an expert near its end, mid-generation)."""
    sizes = [os.path.getsize(path) for path in paths]
    for layout in layouts:
        for part in layout.parts:
            end = part.data_start + layout.n_experts * part.expert_bytes
            if end > sizes[part.file]:
                raise truncated(paths[part.file], part, part.data_start, end)


class DiskReader:
    """Reads experts' pieces from the model's files into slots (moeswap.experts.direct_io);
    safe to call from several threads at once."""

    def __init__(self, paths: Paths, cold: bool = False):
        self.paths = list(paths)
        self.cold = cold
        self.files: dict[int, ModelFile] = {}  # file index -> opened at its first read
        self.stats = ReadStats()
        self.lock = threading.Lock()  # guards stats and files

    def read_expert(self, layout: ExpertLayout, expert: int, slot: np.ndarray) -> None:
        """Read the expert's pieces to their offsets in ``slot``."""
        started = time.perf_counter()
        for _, part, target in slot_pieces(layout, slot):
            self.read_piece(part, expert, target)
        with self.lock:
            self.stats.seconds += time.perf_counter() - started

    def read_piece(self, part: ExpertPart, expert: int, target: np.ndarray,
                   within: int = 0) -> None:
        """Read the piece's bytes from ``within`` on (a chunk of it) into ``target``."""
        start = part.data_start + expert * part.expert_bytes
        try:
            self._file(part.file).read(target, start + within)
        except ShortRead:
            raise truncated(self.paths[part.file], part, start, start + part.expert_bytes) \
                from None
        with self.lock:
            self.stats.bytes += target.nbytes
            self.stats.reads += 1

    def _file(self, file: int) -> ModelFile:
        with self.lock:
            if file not in self.files:
                self.files[file] = ModelFile(self.paths[file], self.cold)
            return self.files[file]

    def close(self) -> None:
        for opened in self.files.values():
            opened.close()
        self.files.clear()
