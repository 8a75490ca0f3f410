"""A softmax router's choice as ggml nodes, llama.cpp's build_moe_ffn routing: the router's
logits (plus its bias), softmax, the top k by ``argsort``, their probabilities picked by
``get_rows``, renormalised (clamped as llama.cpp) and scaled. A layer graph
(moeswap.models.ggml_attention) builds them on its FFN's input.

Legend (ggml order, ne0 first): D model width, X experts, K picks, T tokens.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from moeswap.models.moe import Router
from moeswap.quant import CpuKernels
from moeswap.quant.graph_arena import Arena

_F32 = int(GGMLQuantizationType.F32)
_SORT_DESCENDING = 1  # GGML_SORT_ORDER_DESC
_MIN_SUM = 6.103515625e-5  # llama.cpp clamps the picks' sum at this before renormalising


class GraphRouter:
    """The router's weight (and bias) bound for ggml, and its nodes."""

    def __init__(self, kernels: CpuKernels, router: Router):
        self.ggml, self.router, self.top_k = kernels.ggml, router, router.top_k
        weight = router.weight.detach().to(torch.float32).contiguous()  # [X, D]
        self._weight = kernels.bind(weight.numpy(), _F32, tuple(weight.shape[::-1]), "router")
        self.n_experts = self._weight.ne[1]
        self._bias = None
        if router.bias is not None:
            bias = router.bias.detach().to(torch.float32).contiguous().reshape(-1)  # [X]
            self._bias = kernels.bind(bias.numpy(), _F32, (bias.numel(), 1), "router bias")

    def nodes(self, context: int, arena: Arena, x: int, n_tokens: int) -> tuple[int, int]:
        """x (D, T) -> ids (K, T) I32, contiguous, and weights (1, K, T)."""
        ggml, k, t, r = self.ggml, self.top_k, n_tokens, self.router
        logits = arena.op(ggml.ggml_mul_mat(context, self._weight.tensor, x))  # (X, T)
        if self._bias is not None:
            logits = arena.op(ggml.ggml_add(context, logits, self._bias.tensor))
        probs = arena.op(ggml.ggml_soft_max(context, logits))  # (X, T)
        order = arena.op(ggml.ggml_argsort(context, probs, _SORT_DESCENDING))  # (X, T)
        ids = arena.op(ggml.ggml_cont(context, arena.view(ggml.ggml_view_2d(
            context, order, k, t, self.n_experts * 4, 0))))  # (K, T): argsort_top_k's first k
        weights = arena.op(ggml.ggml_get_rows(context, arena.view(
            ggml.ggml_reshape_3d(context, probs, 1, self.n_experts, t)), ids))  # (1, K, T)
        if r.normalize:
            flat = arena.view(ggml.ggml_reshape_2d(context, weights, k, t))
            total = arena.op(ggml.ggml_clamp(context, arena.op(ggml.ggml_sum_rows(context, flat)),
                                             _MIN_SUM, float("inf")))  # (1, T)
            divided = arena.op(ggml.ggml_div(context, flat, total))  # (K, T)
            weights = arena.view(ggml.ggml_reshape_3d(context, divided, 1, k, t))
            arena.offsets[weights] = arena.offsets[divided]  # the same bytes, copied out
        if r.scale != 1.0:
            weights = arena.op(ggml.ggml_scale(context, weights, r.scale))
        return ids, weights
