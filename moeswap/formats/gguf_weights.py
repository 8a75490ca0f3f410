"""Lazy float32 tensors over a GGUF file's mmap.

F32 tensors are returned as zero-copy views of the mapped file (the page cache holds them, not
the process). Every other type is decoded with ``gguf.quants.dequantize``, which covers every
type the gguf package knows (F16, BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ*, MXFP4). A routed
expert is a contiguous slice of its stacked tensor (the expert index is the outermost GGUF
dimension), so one expert is read without touching the others.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from moeswap.errors import MoeswapError
from moeswap.formats.gguf_file import GGUFFile, TensorInfo
from moeswap.formats.weights import TensorDescription

EXPERT_KINDS = ("gate", "up", "down")


class GGUFWeights:
    def __init__(self, gguf_file: GGUFFile):
        self.file = gguf_file

    def has(self, name: str) -> bool:
        return self.file.tensor(name) is not None

    def tensor(self, name: str) -> torch.Tensor:
        info = self._info(name)
        return self._decode(self.file.tensor_bytes(info), info, tuple(reversed(info.shape)))

    def expert(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        info, rows = self._expert_tensor(layer, kind)
        n_expert = info.shape[2]
        if not 0 <= expert < n_expert:
            raise MoeswapError(f"{self.file.path}: expert {expert} out of range "
                               f"(layer {layer} has {n_expert} experts)")
        per_expert = info.n_bytes // n_expert
        raw = self.file.tensor_bytes(info)[expert * per_expert:(expert + 1) * per_expert]
        matrix = self._decode(raw, info, (info.shape[1], info.shape[0]))  # [out, in]
        return matrix[rows]

    def experts(self, layer: int, kind: str) -> torch.Tensor:
        info, rows = self._expert_tensor(layer, kind)
        stacked = self._decode(self.file.tensor_bytes(info), info, tuple(reversed(info.shape)))
        return stacked[:, rows]  # [E, out, in]

    def describe(self, name: str) -> TensorDescription:
        info = self._info(name)
        return TensorDescription(name, tuple(reversed(info.shape)), info.type_name,
                                 f"{self.file.piece_of(info).path.name} @ {info.data_start}",
                                 info.ggml_type == GGMLQuantizationType.F32)

    def _info(self, name: str) -> TensorInfo:
        info = self.file.tensor(name)
        if info is None:
            raise MoeswapError(f"{self.file.path}: tensor '{name}' is missing; "
                               "the file is incomplete or not of this architecture")
        qtype = info.ggml_type
        if qtype is None or qtype not in GGML_QUANT_SIZES or info.n_bytes < 0:
            raise MoeswapError(f"{self.file.path}: tensor '{name}' has type {info.type_name} "
                               f"and shape {list(info.shape)}, which cannot be decoded")
        piece = self.file.piece_of(info)
        if info.data_end > piece.file_size:
            raise MoeswapError(f"{piece.path}: tensor '{name}' runs past the end of the "
                               "file; the download is probably incomplete")
        return info

    def _expert_tensor(self, layer: int, kind: str) -> tuple[TensorInfo, slice]:
        """The stacked tensor holding `kind` and the rows of each expert matrix that are it."""
        if kind not in EXPERT_KINDS:
            raise ValueError(f"expert kind must be one of {EXPERT_KINDS}, got {kind!r}")
        name = f"blk.{layer}.ffn_{kind}_exps.weight"
        fused = f"blk.{layer}.ffn_gate_up_exps.weight"
        if kind != "down" and not self.has(name) and self.has(fused):
            info = self._info(fused)
            half = info.shape[1] // 2  # fused gate+up: gate rows first
            return info, slice(0, half) if kind == "gate" else slice(half, 2 * half)
        info = self._info(name)
        if len(info.shape) != 3:
            raise MoeswapError(f"{self.file.path}: '{name}' has shape {list(info.shape)}, "
                               "expected 3 dimensions [in, out, n_expert]")
        return info, slice(None)

    @staticmethod
    def _decode(raw: memoryview, info: TensorInfo, shape: tuple[int, ...]) -> torch.Tensor:
        qtype = info.ggml_type
        if qtype == GGMLQuantizationType.F32:
            with warnings.catch_warnings():
                # The mmap is read-only and so is the view; the engine never writes weights.
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(raw, dtype=torch.float32).view(shape)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block_size * type_size
        data = np.frombuffer(raw, dtype=np.uint8).reshape(-1, row_bytes)
        return torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32)
                                .reshape(shape))
