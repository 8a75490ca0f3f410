"""The naive reference every fast kernel is checked against: dequantize in float64, multiply.

Dequantization is gguf-py's numpy code (llama.cpp's own Python package), independent of the
ggml C kernels it checks.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize


def dequantize_matrix(raw, ggml_type: int, ne: tuple[int, ...]) -> np.ndarray:
    """Stored bytes of GGUF shape ``ne`` -> float64 array of shape ``reversed(ne)``."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    row_bytes = ne[0] // block_size * type_size
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, row_bytes)
    values = dequantize(rows, GGMLQuantizationType(ggml_type))  # [rows, in]
    return values.astype(np.float64).reshape(tuple(reversed(ne)))


def reference_matmul(raw, ggml_type: int, ne: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """x: [T, in] -> [T, out] float64, ``x @ W.T`` with W dequantized."""
    weight = torch.from_numpy(dequantize_matrix(raw, ggml_type, ne))  # [out, in]
    return x.double() @ weight.T


def reference_experts(raw, ggml_type: int, ne: tuple[int, int, int], x: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """x: [T, in] or [T, K, in]; ids: [T, K] -> [T, K, out] float64 (T tokens, K picks)."""
    weights = torch.from_numpy(dequantize_matrix(raw, ggml_type, ne))  # [E, out, in]
    rows = x.double().reshape(ids.shape[0], -1, ne[0]).expand(-1, ids.shape[1], -1)  # [T, K, in]
    picked = weights[ids.long()]  # [T, K, out, in]
    return torch.einsum("tkoi,tki->tko", picked, rows)
