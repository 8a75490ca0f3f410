"""``--miss-lowbit TYPE``: a lower-precision copy of every routed expert, served on a miss.

An APPROXIMATION, opt-in and counted. At load, every routed expert's matrices are dequantized
from the file's type (gguf-py, llama.cpp's own Python package) and quantized again to ``TYPE``
by ggml's quantizer (``moeswap.quant.quantize_rows``); bias and scale vectors are copied as they
are. The copies live in one buffer allocated once, a fixed slot per expert, charged to the host
budget. When an expert is in neither the device nor the host tier at full precision and the host
policy does not admit it (the reads that would otherwise land in the staging ring: no host slots,
``admit:N`` before the N-th request), the store computes it from its copy instead of reading the
full-precision bytes from the file. An admitted miss is still read at full precision, so the
policy decides which experts earn full precision.

Counted per layer: ``fires`` (experts computed from a copy) and ``saved_bytes`` (the
full-precision bytes those fires did not read); in total also ``held_bytes`` (the copies).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from moeswap.errors import MoeswapError
from moeswap.experts.settings import LOWBIT_TYPES
from moeswap.experts.tiers import SlotPool, piece_offsets, slot_bytes
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models.quant_experts import ExpertLayout, ExpertPart
from moeswap.quant import quantize_rows


def lowbit_type(name: str) -> GGMLQuantizationType:
    """'q4_0' -> its ggml type; a MoeswapError for a type not offered."""
    if name.lower() not in LOWBIT_TYPES:
        raise MoeswapError(f"--miss-lowbit {name}: not a low-bit copy type this store can make; "
                           f"choose one of {', '.join(LOWBIT_TYPES)}")
    return GGMLQuantizationType[name.upper()]


def lowbit_layout(layout: ExpertLayout, ggml_type: GGMLQuantizationType) -> ExpertLayout:
    """The layout of one expert's copy: each matrix in ``ggml_type``, vectors unchanged."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    matrices = {}
    for kind, part in layout.matrices.items():
        width, rows = part.ne
        if width % block_size:
            raise MoeswapError(
                f"--miss-lowbit {ggml_type.name.lower()}: '{part.name}' rows are {width} values "
                f"wide, not a multiple of its {block_size}-value blocks; choose a type of "
                "32-value blocks (q4_0, q5_0, q8_0)")
        matrices[kind] = dataclasses.replace(
            part, ggml_type=int(ggml_type), expert_bytes=width // block_size * type_size * rows)
    return dataclasses.replace(layout, matrices=matrices)


@dataclass
class LowBitCounts:
    fires: int = 0  # experts computed from their low-bit copy instead of read from the file
    saved_bytes: int = 0  # full-precision bytes those fires did not read


class LowBitCopies:
    """Every routed expert's low-bit copy, each in a fixed slot of one pool allocated once."""

    def __init__(self, gguf: GGUFFile, layouts: dict[int, ExpertLayout], type_name: str):
        self.ggml_type = lowbit_type(type_name)
        self.full_bytes = {i: layout.expert_bytes for i, layout in layouts.items()}
        self.layouts = {i: lowbit_layout(layout, self.ggml_type) for i, layout in layouts.items()}
        for i, layout in self.layouts.items():
            if layout.expert_bytes >= self.full_bytes[i]:
                down = layouts[i].matrices["down"]
                raise MoeswapError(
                    f"--miss-lowbit {type_name}: a copy would not be smaller than the file's "
                    f"expert ('{down.name}' is {GGMLQuantizationType(down.ggml_type).name}); "
                    "choose a type of fewer bits, e.g. q4_0")
        keys = [(i, e) for i, layout in layouts.items() for e in range(layout.n_experts)]
        self.pool = SlotPool("lowbit", len(keys), slot_bytes(list(self.layouts.values())))
        self.index = {key: self.pool.take(key) for key in keys}  # never released
        for i, layout in layouts.items():
            self._fill(gguf, i, layout)
        self.counts = {i: LowBitCounts() for i in layouts}

    def _fill(self, gguf: GGUFFile, layer: int, layout: ExpertLayout) -> None:
        """One expert at a time, so that only one expert's float values exist at once."""
        copy_layout = self.layouts[layer]
        offsets = piece_offsets(copy_layout)
        for part, copy, offset in zip(layout.parts, copy_layout.parts, offsets):
            stack = np.frombuffer(gguf.tensor_bytes(gguf.tensor(part.name)), dtype=np.uint8)
            for expert in range(layout.n_experts):
                stored = stack[expert * part.expert_bytes:(expert + 1) * part.expert_bytes]
                slot = self.pool.slot(self.index[layer, expert])
                slot[offset:offset + copy.expert_bytes] = \
                    self._requantize(part, stored) if part.is_matrix else stored

    def _requantize(self, part: ExpertPart, stored: np.ndarray) -> np.ndarray:
        """One expert matrix's stored bytes in the file's type -> its bytes in the copy type."""
        source = GGMLQuantizationType(part.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[source]
        rows = stored.reshape(part.ne[1], part.ne[0] // block_size * type_size)  # [out, bytes]
        try:
            values = dequantize(rows, source)  # [out, in]
        except NotImplementedError:
            raise MoeswapError(f"--miss-lowbit: '{part.name}' is {source.name}, which cannot be "
                               "dequantized here to make a copy; leave --miss-lowbit off") from None
        return quantize_rows(values.astype(np.float32), self.ggml_type).reshape(-1)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def serve(self, key: tuple[int, int]) -> tuple[str, int]:
        """A miss served from the copy: counted -> ("lowbit", slot)."""
        counts = self.counts[key[0]]
        counts.fires += 1
        counts.saved_bytes += self.full_bytes[key[0]]
        return "lowbit", self.index[key]

    def as_dict(self) -> dict:
        fires = sum(c.fires for c in self.counts.values())
        saved = sum(c.saved_bytes for c in self.counts.values())
        return {"type": self.ggml_type.name.lower(), "fires": fires, "saved_bytes": saved,
                "held_bytes": self.nbytes,
                "layers": {i: dataclasses.asdict(c) for i, c in self.counts.items()}}
