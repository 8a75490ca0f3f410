"""A DeepSeek-V2/V3 layer's MLA attention (moeswap.models.mla) as one ggml graph: the input
norm, the query and latent projections, RoPE, the absorbed query, the cache write, scores,
softmax, the latent values, v_b, the output projection, the residual and the FFN's norm, in
llama.cpp's ops and order (src/models/deepseek2.cpp with MLA, llama-graph.cpp build_attn_mha
without flash attention), so that an f16 cache rounds what llama.cpp rounds.

llama.cpp absorbs k_b and v_b (the converter writes attn_k_b and attn_v_b): each token caches
one row, the normed latent then its rotated key part (L+R), a single KV head; the values are
the latent part of the same rows, copied transposed (``ggml_cont``) before their product, and
v_b decompresses each head's result. moeswap's cache is the torch path's (keys [C, 1, L+R],
no values), so the two paths share it. The FFN stays the layer's own (``LayerStep.h`` and
``ffn_input``). Pieces, kept graphs and their inputs: moeswap.models.sequence_graph.

Legend (ggml order, ne0 first): D model width, H heads, P non-rotated and R rotated dims of a
query/key head, L kv_lora_rank, V value dims per head, Q q_lora_rank, C slots of the layer's
cache, S attended slots (C or a multiple of SLOT_SPAN), T tokens of a piece.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moeswap.models.blocks import Batch, LayerStep, Rope
from moeswap.models.kv_graph_inputs import bind_cache
from moeswap.models.linear import QuantHeads, QuantLinear, TorchHeads, TorchLinear
from moeswap.models.mla import MLAttention
from moeswap.models.sequence_graph import F32, SequenceGraph
from moeswap.quant import CpuKernels
from moeswap.quant.graph_arena import Arena
from moeswap.quant.q8_0_kernel import matrix_product

_ROPE_NEOX = 2  # GGML_ROPE_TYPE_NEOX; 0 is llama.cpp's NORM layout (DeepSeek's)


def attach(layers: list, kernels: CpuKernels) -> None:
    """Give each pre-norm layer whose MLA attention ``supports`` allows its graph."""
    for layer in layers:
        attention = getattr(layer, "attention", None)
        if (hasattr(layer, "graph") and isinstance(attention, MLAttention)
                and getattr(layer, "residual_scale", 1.0) == 1.0 and supports(attention)):
            layer.graph = MlaLayerGraph(kernels, attention, layer.attn_norm, layer.ffn_norm,
                                        layer.eps)


def supports(attention: MLAttention) -> bool:
    """Whether the graph computes ``attention`` (plain or YaRN RoPE without factors, bias-free
    projections of a kind it can bind)."""
    w, rope = attention.w, attention.rope
    linears = [p for p in (w.wq, w.wq_a, w.wq_b, w.wkv_a, w.wo) if p is not None]
    return (type(rope) is Rope and rope.freq_factors is None
            and (rope.yarn is not None or rope.mscale == 1.0)
            and all(isinstance(p, (QuantLinear, TorchLinear)) and p.bias is None
                    for p in linears)
            and all(isinstance(p, (QuantHeads, TorchHeads)) for p in (w.wk_b, w.wv_b)))


def llama_cpp_scales(rope: Rope, scale: float, key_length: int) -> tuple[float, float]:
    """(rope_ext's attn_factor, the softmax's kq_scale) in llama.cpp's float32 arithmetic
    (llama-context.cpp's yarn_attn_factor, deepseek2.cpp's kq_scale): computed in doubles,
    kq_scale lands an ulp away, and every probability with it. ``scale`` (the config's
    mscale(log_mul)^2 / sqrt(key_length)) gives back the file's yarn_log_multiplier."""
    f32 = np.float32

    def logf(value) -> np.float32:
        return f32(math.log(float(value)))

    one, tenth = f32(1.0), f32(0.1)
    factor = f32(rope.yarn.factor if rope.yarn is not None else 1.0)
    freq_scale = one / factor
    log_mul = f32(0.0)
    attn_factor = one
    if rope.yarn is not None:
        mscale = math.sqrt(scale * math.sqrt(key_length))  # 0.1 * log_mul * ln(factor) + 1
        log_mul_key = f32((mscale - 1.0) / math.log(rope.yarn.factor))  # as the file stores it
        log_mul = log_mul_key / tenth
        if log_mul_key:  # DeepSeek-V2's special case: mscale(mscale_all_dim) over itself
            attn_factor, attn_key = one, f32(rope.yarn.mscale)
        else:
            attn_factor = tenth * one * logf(factor) + one
            attn_key = f32(rope.yarn.mscale / (0.1 * math.log(rope.yarn.factor) + 1.0))
        attn_factor = attn_factor * (one / (one + tenth * logf(factor))) * attn_key
    original = attn_factor * (one + tenth * logf(one / freq_scale))
    mscale32 = original * (one + tenth * log_mul * logf(one / freq_scale))
    kq_scale = one * mscale32 * mscale32 / f32(math.sqrt(key_length))
    return float(attn_factor), float(kq_scale)


class MlaLayerGraph(SequenceGraph):
    """A pre-norm MLA layer's attention with the norms and residual around it, computed by
    ggml: x [N, D], batch -> ``LayerStep`` (h, ffn_input); each sequence against its cache."""

    def __init__(self, kernels: CpuKernels, attention: MLAttention, input_norm: torch.Tensor,
                 next_norm: torch.Tensor, eps: float):
        a, w = attention, attention.w
        # keys [C, 1, L+R] and no values: the torch path's entries (MLAttention)
        super().__init__(kernels, a.layer, input_norm.shape[0], 2, (1, a.rank + a.n_rot), (1, 0))
        self.attention, self.eps = attention, eps
        self.heads, self.nope, self.rot, self.rank = a.n_head, a.n_nope, a.n_rot, a.rank
        self.key_width = a.rank + a.n_rot  # L+R
        self.matrices = {name: self._weight(p, name) for name, p in (
            ("wq", w.wq), ("wq_a", w.wq_a), ("wq_b", w.wq_b), ("wkv_a", w.wkv_a),
            ("wk_b", w.wk_b), ("wv_b", w.wv_b), ("wo", w.wo)) if p is not None}
        self.value_width = self.matrices["wv_b"].ne[1]  # V
        self.vectors = {name: self.bind(v, f"MLA {name}") for name, v in (
            ("input_norm", input_norm), ("next_norm", next_norm), ("kv_a_norm", w.kv_a_norm),
            ("q_a_norm", w.q_a_norm)) if v is not None}
        self.attn_factor, self.kq_scale = llama_cpp_scales(a.rope, a.spec.scale,
                                                           a.n_nope + a.n_rot)

    def _weight(self, source, name: str):
        """A projection's weight as a ggml tensor: quantized ones as bound, float ones bound
        as F32: matrices (D, O), head stacks (D, O, H)."""
        if isinstance(source, QuantLinear):
            return source.matrix.weight
        if isinstance(source, QuantHeads):
            return source.stack.weight
        return self.bind(source.weight, f"MLA {name}")

    def __call__(self, x: torch.Tensor, batch: Batch) -> LayerStep:
        """x [N, D] -> h and the FFN's input [N, D]."""
        return LayerStep(*super().__call__(x, batch))

    def token_bytes(self, capacity: int) -> int:
        """Scores, probabilities and mask (S (2H+1)), the per-head queries and results, a
        few (D)."""
        return 4 * (capacity * (2 * self.heads + 1) + 12 * self.width
                    + 4 * self.heads * (self.key_width + self.nope + self.value_width))

    def nodes(self, context: int, arena: Arena, slots, inputs: dict[str, int], t: int,
              n_slots: int) -> tuple[list[int], list[int]]:
        """deepseek2.cpp's MLA branch for T = t tokens over S = n_slots slots -> (the copies
        into Qcur and Kcur and the cache write; h and the FFN's input)."""
        ggml, m, vec = self.ggml, self.matrices, self.vectors
        h, p, r, lat, kw = self.heads, self.nope, self.rot, self.rank, self.key_width
        x, positions = inputs["x"], inputs["positions"]  # (D, T), (T)

        def op(tensor: int) -> int:
            return arena.op(tensor)

        def view(tensor: int) -> int:
            return arena.view(tensor)

        def norm(y: int, name: str) -> int:
            normed = op(ggml.ggml_rms_norm(context, y, self.eps))
            return op(ggml.ggml_mul(context, normed, vec[name].tensor))

        def product(name: str, y: int) -> int:
            return matrix_product(self.kernels, context, arena, m[name], y)

        def rope(y: int) -> int:
            a = self.attention.rope
            yarn = a.yarn
            return op(ggml.ggml_rope_ext(
                context, y, positions, None, r, _ROPE_NEOX if a.neox else 0,
                yarn.orig_ctx if yarn else 0, a.base,
                float(np.float32(1.0) / np.float32(yarn.factor if yarn else a.scale)),
                1.0 if yarn else 0.0, self.attn_factor,
                yarn.beta_fast if yarn else 32.0, yarn.beta_slow if yarn else 1.0))

        xn = norm(x, "input_norm")  # (D, T)
        if "wq" in m:
            q = product("wq", xn)  # (H*(P+R), T)
        else:
            q = product("wq_b", norm(product("wq_a", xn), "q_a_norm"))
        q = view(ggml.ggml_reshape_3d(context, q, p + r, h, t))  # (P+R, H, T)
        kv = product("wkv_a", xn)  # (L+R, T)
        latent = view(ggml.ggml_view_2d(context, kv, lat, t, kw * 4, 0))  # (L, T)
        k_pe = rope(view(ggml.ggml_view_3d(context, kv, r, 1, t, kw * 4, kw * 4,
                                           lat * 4)))  # (R, 1, T)
        latent = norm(latent, "kv_a_norm")  # (L, T)
        head_bytes = (p + r) * 4
        q_nope = view(ggml.ggml_view_3d(context, q, p, h, t, head_bytes, head_bytes * h, 0))
        q_pe = rope(view(ggml.ggml_view_3d(context, q, r, h, t, head_bytes, head_bytes * h,
                                           p * 4)))  # (R, H, T)
        q_nope = view(ggml.ggml_permute(context, q_nope, 0, 2, 1, 3))  # (P, T, H)
        absorbed = product("wk_b", q_nope)  # (L, T, H)
        absorbed = view(ggml.ggml_permute(context, absorbed, 0, 2, 1, 3))  # (L, H, T)
        # Qcur and Kcur: llama.cpp's ggml_concat along ne0, as two copies into one tensor.
        queries = arena.new(F32, kw, h, t)  # (L+R, H, T)
        keys_new = arena.new(F32, kw, t)  # (L+R, T)
        first = []
        for part, into, width, offset in (
                (absorbed, queries, lat, 0), (q_pe, queries, r, lat),
                (view(ggml.ggml_reshape_3d(context, latent, lat, 1, t)), keys_new, lat, 0),
                (k_pe, keys_new, r, lat)):
            rows = h if into == queries else 1
            first.append(view(ggml.ggml_cpy(context, part, view(ggml.ggml_view_3d(
                context, into, width, rows, t, kw * 4, kw * rows * 4, offset * 4)))))
        cache_keys, _ = bind_cache(ggml, context, slots, kw, self.buffers)  # (L+R, C)
        first.append(view(ggml.ggml_set_rows(context, cache_keys, keys_new,
                                             inputs["key_slots"])))
        row = kw * slots.keys.element_size()
        keys = view(ggml.ggml_view_3d(context, cache_keys, kw, n_slots, 1, row, row,
                                      0))  # (L+R, S, 1)
        q_rows = view(ggml.ggml_permute(context, queries, 0, 2, 1, 3))  # (L+R, T, H)
        scores = op(ggml.ggml_mul_mat(context, keys, q_rows))  # (S, T, H)
        probs = op(ggml.ggml_soft_max_ext(context, scores, inputs["mask"], self.kq_scale, 0.0))
        # the values: the latent part of the cached rows, (L, S, 1) copied as (S, L, 1)
        values = view(ggml.ggml_view_3d(context, cache_keys, lat, n_slots, 1, row, row, 0))
        values = op(ggml.ggml_cont(context, view(ggml.ggml_permute(context, values, 1, 0, 2,
                                                                   3))))
        heads = op(ggml.ggml_mul_mat(context, values, probs))  # (L, T, H)
        heads = product("wv_b", heads)  # (V, T, H)
        heads = op(ggml.ggml_cont(context, view(ggml.ggml_permute(context, heads, 0, 2, 1,
                                                                  3))))  # (V, H, T)
        heads = view(ggml.ggml_reshape_2d(context, heads, self.value_width * h, t))  # (V*H, T)
        h_out = op(ggml.ggml_add(context, product("wo", heads), x))  # (D, T)
        return first, [h_out, norm(h_out, "next_norm")]


