"""Linear layers and embeddings as the model sees them: one call, whatever holds the weight.

The loader chooses the kind per tensor: ``TorchLinear`` over a float tensor (HF folders, F32
GGUF tensors: zero-copy views of the mapped file) or ``QuantLinear`` over a ggml kernel bound to
the stored bytes (every other GGUF type; no float32 copy is ever made). The model calls
``layer(x)`` and never knows which.

``TorchHeads`` / ``QuantHeads`` do the same for a stack of one matrix per attention head (MLA's
``attn_k_b`` and ``attn_v_b``), the quantized one through ggml's mul_mat_id, whose activations
are rounded (F16) or quantized (Q8_0 ...) per head as llama.cpp's batched mul_mat does.

Legend: N tokens, D input width, O output width, V vocabulary, H heads.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from moeswap.quant import QuantExperts, QuantMatrix


class TorchLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # [O, D]
        self.bias = bias  # [O]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, O]."""
        return F.linear(x, self.weight, self.bias)


class QuantLinear:
    """``x @ W.T (+ b)`` computed by ggml from W's stored bytes; activations are quantized on
    the fly as llama.cpp does (docs/KERNELS.md gives the cost)."""

    def __init__(self, matrix: QuantMatrix, bias: torch.Tensor | None = None):
        self.matrix = matrix
        self.bias = bias  # [O]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, O]."""
        y = self.matrix.matmul(x)  # [N, O]
        return y if self.bias is None else y + self.bias


class TorchHeads:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [H, O, D]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H, D] -> [N, H, O]: head h through its own matrix."""
        return torch.einsum("nhd,hod->nho", x, self.weight)


class QuantHeads:
    """The per-head stack computed by ggml from its stored bytes (GGUF shape (in, out, H))."""

    def __init__(self, stack: QuantExperts):
        self.stack = stack

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H, D] -> [N, H, O]."""
        heads = torch.arange(x.shape[1], dtype=torch.int32).expand(x.shape[0], -1)  # [N, H]
        return self.stack.matmul(x, heads)


class TorchEmbedding:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [V, D]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> [N, D]."""
        return F.embedding(ids, self.weight)


class QuantEmbedding:
    """Rows decoded from the stored bytes when looked up; the table is never decoded whole."""

    def __init__(self, raw: memoryview, ggml_type: int, ne: tuple[int, int]):
        self.ggml_type = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        self.width = ne[0]
        row_bytes = ne[0] // block_size * type_size
        self.rows = np.frombuffer(raw, dtype=np.uint8).reshape(ne[1], row_bytes)  # [V, row bytes]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> [N, D] float32."""
        picked = self.rows[ids.reshape(-1).numpy()]  # [N, row bytes]
        return torch.from_numpy(np.ascontiguousarray(dequantize(picked, self.ggml_type),
                                                     dtype=np.float32).reshape(-1, self.width))
