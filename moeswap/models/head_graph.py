"""The final norm and the output head as ggml computes them: rms_norm, times the norm's weight,
then the head's product, as llama.cpp ends a token's graph.

Its own graph after the layers run one by one, or the end of a token graph
(moeswap.models.token_graph): both give the same bits. Torch's rms_norm sums the squares in
another order than ggml's and can land a scale one ulp away (rarely: tests/test_token_graph).

Legend (ggml order, ne0 first): D model width, T tokens, V vocabulary.
"""

from __future__ import annotations

import weakref

import torch
from gguf import GGMLQuantizationType

from moeswap.models.causal_lm import CausalLM
from moeswap.models.ggml_ffn import bound_matrix
from moeswap.models.linear import QuantLinear, TorchLinear
from moeswap.quant import MAX_TOKENS_PER_CALL, CpuKernels
from moeswap.quant.graph_arena import Arena, free_contexts, new_context
from moeswap.quant.q8_0_kernel import PRODUCT_NODES, matrix_product

_F32 = int(GGMLQuantizationType.F32)
HEAD_NODES = 7 + PRODUCT_NODES  # tensors and nodes ``nodes`` makes, with room


class HeadGraph:
    """x [N, D] -> logits [N, V] (before the model's logit scale and soft-cap), in groups of
    MAX_TOKENS_PER_CALL tokens, one kept graph per group size."""

    def __init__(self, kernels: CpuKernels, output_norm: torch.Tensor, eps: float,
                 output: QuantLinear | TorchLinear):
        self.kernels, self.ggml, self.eps = kernels, kernels.ggml, eps
        norm = output_norm.detach().to(torch.float32).contiguous()
        self._norm = kernels.bind(norm.numpy(), _F32, (norm.numel(), 1), "output_norm")  # (D)
        self._head = bound_matrix(kernels, output, "output")  # ne (D, V)
        self.width, self.vocabulary = self._head.ne
        self._graphs: dict[int, tuple[int, int, int]] = {}  # T -> graph, x's and logits' offsets
        self._contexts: list[int] = []
        weakref.finalize(self, free_contexts, self.ggml, self._contexts)

    def nodes(self, context: int, arena: Arena, x: int) -> int:
        """x (D, T) -> the logits (V, T)."""
        ggml = self.ggml
        normed = arena.op(ggml.ggml_rms_norm(context, x, self.eps))
        normed = arena.op(ggml.ggml_mul(context, normed, self._norm.tensor))  # (D, T)
        return matrix_product(self.kernels, context, arena, self._head, normed)  # (V, T)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> logits [N, V]."""
        x = x.to(torch.float32).contiguous()
        logits = torch.empty(x.shape[0], self.vocabulary)
        for start in range(0, x.shape[0], MAX_TOKENS_PER_CALL):
            rows = x[start:start + MAX_TOKENS_PER_CALL]  # [t, D]
            out = logits[start:start + rows.shape[0]]  # [t, V]
            graph, source, result = self._graph(rows.shape[0])
            self.kernels.run(graph, [(source, rows.data_ptr(), rows.nbytes)],
                             (out.data_ptr(), out.nbytes), result)
        return logits

    def _graph(self, n_tokens: int) -> tuple[int, int, int]:
        if n_tokens not in self._graphs:
            ggml = self.ggml
            context = new_context(ggml, HEAD_NODES)
            self._contexts.append(context)
            arena = Arena(self.kernels, context)
            x = arena.new(_F32, self.width, n_tokens)  # (D, T)
            logits = self.nodes(context, arena, x)
            graph = ggml.ggml_new_graph_custom(context, HEAD_NODES, False)
            ggml.ggml_build_forward_expand(graph, logits)
            self._graphs[n_tokens] = (graph, arena.offsets[x], arena.offsets[logits])
        return self._graphs[n_tokens]


def attach(model, kernels: CpuKernels) -> HeadGraph | None:
    """The model's head graph, where its final norm is the plain RMS norm and its head a
    product without bias (else None: the torch code computes them)."""
    output = model.output
    if (type(model).final_norm is not CausalLM.final_norm
            or not isinstance(output, (QuantLinear, TorchLinear)) or output.bias is not None):
        return None
    return HeadGraph(kernels, model.output_norm, model.config.rms_eps, output)
