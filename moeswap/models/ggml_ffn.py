"""A dense gated feed-forward (``DenseFFN``: a dense layer, Gemma 3's FFN, a shared expert) as
one ggml graph: gate and up products, the activation, their product and the down product.
Its matrices are the quantized ones or F32 ones (an F32 GGUF's, mapped), bound as they lie:
ggml's f32 products, as llama.cpp's on the same file, where torch would sum in another order.

Where the torch path makes three ggml graphs and the activation and product in torch, this makes
one graph per piece of at most ``MAX_TOKENS_PER_CALL`` tokens (the pieces ``QuantMatrix`` cuts),
built once per piece length and kept; a single sequence's layer graph builds the same ``nodes``
into its own (moeswap.models.ggml_attention). The activation is ggml's ``swiglu_split`` for SiLU and
tanh GELU written in ggml's exact ops (moeswap.quant.moe_graph.gelu_tanh), as the expert graph
computes them, so the products and activation agree with the torch path within a rounding.

Legend (ggml order): D model width, F hidden width, T tokens of a piece.
"""

from __future__ import annotations

import weakref

import torch
from gguf import GGMLQuantizationType

from moeswap.models.blocks import DenseFFN
from moeswap.models.linear import QuantLinear, TorchLinear
from moeswap.quant import MAX_TOKENS_PER_CALL, CpuKernels
from moeswap.quant.ggml_lib import InitParams
from moeswap.quant.graph_arena import Arena, free_contexts
from moeswap.quant.moe_graph import gelu_tanh
from moeswap.quant.q8_0_kernel import PRODUCT_NODES, matrix_product

_F32 = int(GGMLQuantizationType.F32)


def attach(layers: list, kernels: CpuKernels) -> None:
    """Give every ``DenseFFN`` of the layers (the layer's FFN, or its MoE block's shared
    expert) whose matrices ggml can take as they are (``bound_matrix``) its graph."""
    for layer in layers:
        ffn = getattr(layer, "ffn", None)
        shared = getattr(ffn, "shared", None)
        for dense in (ffn, getattr(shared, "ffn", None)):
            if isinstance(dense, DenseFFN) and all(
                    p.bias is None and bindable(p) for p in (dense.gate, dense.up, dense.down)):
                dense.graph = DenseFfnGraph(kernels, dense)


def bindable(linear) -> bool:
    """Whether ``bound_matrix`` takes ``linear`` without copying its weight: a quantized one,
    or a float32 one laid out as a GGUF stores it."""
    return isinstance(linear, QuantLinear) or (
        isinstance(linear, TorchLinear) and linear.weight.dtype == torch.float32
        and linear.weight.is_contiguous())


def bound_matrix(kernels: CpuKernels, linear: QuantLinear | TorchLinear, name: str):
    """The linear's weight as a bound ggml tensor of ne (in, out): the quantized one, or the
    float one (an F32 GGUF tensor, mapped) bound as F32, not copied when it is ``bindable``."""
    if isinstance(linear, QuantLinear):
        return linear.matrix.weight
    rows = linear.weight.detach().to(torch.float32).contiguous()  # [out, in]
    return kernels.bind(rows.numpy(), _F32, (rows.shape[1], rows.shape[0]), name)


class DenseFfnGraph:
    """``DenseFFN.__call__`` computed by ggml: x [N, D] -> [N, D]."""

    def __init__(self, kernels: CpuKernels, ffn: DenseFFN):
        self.kernels, self.ggml, self.gelu = kernels, kernels.ggml, ffn.gelu
        self.gate, self.up, self.down = (bound_matrix(kernels, p, f"ffn {name}") for p, name in
                                         ((ffn.gate, "gate"), (ffn.up, "up"), (ffn.down, "down")))
        self.width, self.out_width = self.gate.ne[0], self.down.ne[1]
        self.hidden_width = self.gate.ne[1]  # F
        self._graphs: dict[int, tuple[int, int, int]] = {}  # T -> graph, x offset, output offset
        self._contexts: list[int] = []
        weakref.finalize(self, free_contexts, kernels.ggml, self._contexts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        x = x.detach().to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], self.out_width)  # [N, D]
        for start in range(0, x.shape[0], MAX_TOKENS_PER_CALL):
            piece, out = x[start:start + MAX_TOKENS_PER_CALL], y[start:start + MAX_TOKENS_PER_CALL]
            if piece.shape[0] not in self._graphs:
                self._graphs[piece.shape[0]] = self._build(piece.shape[0])
            graph, x_offset, y_offset = self._graphs[piece.shape[0]]
            self.kernels.run(graph, [(x_offset, piece.data_ptr(), piece.nbytes)],
                             (out.data_ptr(), out.nbytes), y_offset)
        return y

    def nodes(self, context: int, arena: Arena, x: int) -> int:
        """The FFN's nodes on x (D, T) -> (D, T); a layer graph builds them into its own."""
        ggml = self.ggml
        gate = matrix_product(self.kernels, context, arena, self.gate, x)  # (F, T)
        up = matrix_product(self.kernels, context, arena, self.up, x)  # (F, T)
        if self.gelu:
            hidden = arena.op(ggml.ggml_mul(context, gelu_tanh(ggml, context, arena, gate), up))
        else:
            hidden = arena.op(ggml.ggml_swiglu_split(context, gate, up))
        return matrix_product(self.kernels, context, arena, self.down, hidden)  # (D, T)

    def _build(self, n_tokens: int) -> tuple[int, int, int]:
        ggml = self.ggml
        n_nodes = 32 + 3 * PRODUCT_NODES
        size = n_nodes * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead_custom(n_nodes,
                                                                                       False)
        context = ggml.ggml_init(InitParams(size, None, True))
        self._contexts.append(context)
        arena = Arena(self.kernels, context)
        x = arena.new(_F32, self.width, n_tokens)  # (D, T)
        y = self.nodes(context, arena, x)  # (D, T)
        graph = ggml.ggml_new_graph_custom(context, n_nodes, False)
        ggml.ggml_build_forward_expand(graph, y)
        return graph, arena.offsets[x], arena.offsets[y]
