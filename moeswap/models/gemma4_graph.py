"""A Gemma 4 layer's attention (moeswap.models.gemma4) as one ggml graph: the input norm, q/k/v
projections (the key projection as values where the layer has no attn_v), the q/k norms and
the weightless value norm, RoPE (proportional on global layers: rope_freqs), the KV cache
write, scores, softmax, values, the output projection, the post-attention norm and the
residual, in llama.cpp's ops and order (src/models/gemma4.cpp, llama-graph.cpp build_attn_mha
without flash attention), so that an f16 cache rounds what llama.cpp rounds. Where the
layer's FFN can join (its dense FFN has a graph, its experts lie in the mapped file, no
recorder), the graph is the whole layer, in gemma4.cpp's order: the dense FFN and its post
norm, the router on rms_norm(h) / sqrt(D) * scale, the experts on their pre norm and their post
norm, the sum, the FFN's post norm, the residual and the output scale, every norm ggml's (torch's
rms_norm sums in another order: one f32 rounding in six lands elsewhere, and ggml's f16-table
GELU turns such ulps into 1e-4 of the logits). Else the FFN stays the layer's; it gets h.
Pieces, kept graphs and their inputs: moeswap.models.sequence_graph.

Legend (ggml order, ne0 first): D model width, H query heads, K kv heads, E head size, C slots
of the layer's cache, S attended slots, T tokens of a piece, F FFN width, X experts, P picks.
"""

from __future__ import annotations

import numpy as np
import torch

from moeswap.models.blocks import Batch, Rope
from moeswap.models.gemma4 import Gemma4Attention, Gemma4Layer
from moeswap.models.ggml_ffn import DenseFfnGraph
from moeswap.models.graph_routing import GraphRouter
from moeswap.models.kv_graph_inputs import bind_cache
from moeswap.models.linear import QuantLinear, TorchLinear
from moeswap.models.quant_experts import QuantResidentExperts
from moeswap.models.sequence_graph import SequenceGraph
from moeswap.quant import MAX_TOKENS_PER_CALL, CpuKernels
from moeswap.quant.graph_arena import Arena
from moeswap.quant.q8_0_kernel import PRODUCT_NODES, matrix_product

_ROPE_NEOX = 2  # GGML_ROPE_TYPE_NEOX (Gemma's layout)


def attach(layers: list, kernels: CpuKernels) -> None:
    """Give each Gemma 4 layer whose attention ``supports`` allows its graph (``layer.graph``,
    x -> h)."""
    for layer in layers:
        if isinstance(layer, Gemma4Layer) and supports(layer.attention):
            layer.graph = Gemma4AttentionGraph(kernels, layer)


def supports(attention: Gemma4Attention) -> bool:
    """Whether the graph computes ``attention``: plain RoPE, bias-free projections it can bind."""
    rope = attention.rope
    return (type(rope) is Rope and rope.yarn is None and rope.mscale == 1.0
            and all(isinstance(p, (QuantLinear, TorchLinear)) and p.bias is None
                    for p in (attention.wq, attention.wk, attention.wv, attention.wo)
                    if p is not None))


class Gemma4AttentionGraph(SequenceGraph):
    """x [N, D], batch -> h = x + post_norm(attention(input_norm(x))) [N, D], or the layer's
    output where ``whole``; each sequence against its own cache (the torch path's entries:
    keys and values [K, E])."""

    n_tensors = 256 + 8 * (PRODUCT_NODES - 1)  # 8 products

    def __init__(self, kernels: CpuKernels, layer: Gemma4Layer):
        a, s = layer.attention, layer.attention.spec
        width = layer.norms["attn_norm"].shape[0]
        super().__init__(kernels, a.layer, width, 1, (s.n_head_kv, s.head_dim),
                         (s.n_head_kv, s.head_dim), s.window)
        self.attention, self.eps = a, layer.eps
        self.matrices = {name: (p.matrix.weight if isinstance(p, QuantLinear)
                                else self.bind(p.weight, f"Gemma 4 {name}"))
                         for name, p in (("wq", a.wq), ("wk", a.wk), ("wv", a.wv), ("wo", a.wo))
                         if p is not None}
        moe = layer.moe
        self.dense_ffn = (layer.ffn.graph if isinstance(layer.ffn.graph, DenseFfnGraph)
                          else None)
        # Routed experts join only where tiers need not agree bit for bit (repacked layouts,
        # no --exact-tiers): the store's runs keep the torch FFN around their experts.
        self.whole = self.dense_ffn is not None and (moe is None or (
            kernels.repack and moe.recorder is None
            and isinstance(moe.experts, QuantResidentExperts)))
        self.router = GraphRouter(kernels, moe.router) if self.whole and moe else None
        self.routed = moe.experts.fused(moe.layer) if self.router else None
        if self.router is not None:
            self.max_piece = MAX_TOKENS_PER_CALL  # the store's groups of tokens
            self.n_tensors += 16 * self.router.top_k  # the experts' nodes per pick
        norms = dict(layer.norms, router_scale=moe.router_scale if moe else None,
                     pre_ffw_norm_2=moe.pre_norm if moe else None,
                     out_scale=layer.out_scale) if self.whole else {}
        self.vectors = {name: self.bind(v, f"Gemma 4 {name}").tensor for name, v in (
            ("attn_norm", layer.norms["attn_norm"]),
            ("post_attention_norm", layer.norms["post_attention_norm"]), ("q_norm", a.q_norm),
            ("k_norm", a.k_norm), ("rope_freqs", a.rope.freq_factors), *norms.items())
            if v is not None}

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [N, D] -> h [N, D], or the layer's output [N, D] where ``whole``."""
        return super().__call__(x, batch)[0]

    def token_bytes(self, capacity: int) -> int:
        """Scores, probabilities and mask (S (2H+1)), q, k, v and the heads, a few (D); the
        dense FFN's (F) x 11 and the experts' (F, P) x 3 and (D, P) x 3."""
        s = self.attention.spec
        ffn = 11 * self.dense_ffn.hidden_width if self.whole else 0
        if self.routed is not None:
            ffn += 3 * self.router.top_k * (self.routed.hidden_width + self.width)
        return 4 * (capacity * (2 * s.n_head + 1) + 16 * self.width
                    + 6 * s.n_head * s.head_dim + ffn)

    def nodes(self, context: int, arena: Arena, slots, inputs: dict[str, int], t: int,
              n_slots: int) -> tuple[list[int], list[int]]:
        """gemma4.cpp's attention for T = t tokens over S = n_slots slots -> (the cache
        writes; h)."""
        ggml, m, vec, s = self.ggml, self.matrices, self.vectors, self.attention.spec
        e, h, kv = s.head_dim, s.n_head, s.n_head_kv
        x = inputs["x"]  # (D, T)

        def op(tensor: int) -> int:
            return arena.op(tensor)

        def view(tensor: int) -> int:
            return arena.view(tensor)

        def norm(y: int, name: str | None) -> int:
            normed = op(ggml.ggml_rms_norm(context, y, self.eps))
            return op(ggml.ggml_mul(context, normed, vec[name])) if name else normed

        def product(name: str, y: int) -> int:
            return matrix_product(self.kernels, context, arena, m[name], y)

        def rope(y: int) -> int:
            r = self.attention.rope
            return op(ggml.ggml_rope_ext(
                context, y, inputs["positions"], vec.get("rope_freqs"), r.n_rot,
                _ROPE_NEOX if r.neox else 0, 0, r.base, 1.0 / r.scale, 0.0, 1.0, 32.0, 1.0))

        xn = norm(x, "attn_norm")  # (D, T)
        q = view(ggml.ggml_reshape_3d(context, product("wq", xn), e, h, t))  # (E, H, T)
        q = rope(norm(q, "q_norm"))
        k_all = product("wk", xn)  # (K*E, T)
        v_all = product("wv", xn) if "wv" in m else k_all  # llama.cpp: Vcur = Kcur
        k = rope(norm(view(ggml.ggml_reshape_3d(context, k_all, e, kv, t)), "k_norm"))
        v = norm(view(ggml.ggml_reshape_3d(context, v_all, e, kv, t)), None)  # (E, K, T)
        cache_keys, cache_values = bind_cache(ggml, context, slots, kv * e, self.buffers)
        writes = [view(ggml.ggml_set_rows(context, cache_keys, view(ggml.ggml_reshape_2d(
                      context, k, kv * e, t)), inputs["key_slots"])),
                  view(ggml.ggml_set_rows(context, cache_values, view(ggml.ggml_reshape_2d(
                      context, v, 1, t * kv * e)), inputs["value_slots"]))]  # v_trans
        row = slots.keys[0].nbytes  # of a slot's K*E keys
        keys = view(ggml.ggml_view_3d(context, cache_keys, e, n_slots, kv, row, row // kv, 0))
        q_rows = view(ggml.ggml_permute(context, q, 0, 2, 1, 3))  # (E, T, H)
        scores = op(ggml.ggml_mul_mat(context, keys, q_rows))  # (S, T, H)
        probs = op(ggml.ggml_soft_max_ext(context, scores, inputs["mask"], s.scale, 0.0))
        size_of = slots.keys.element_size()
        values = view(ggml.ggml_view_3d(context, cache_values, n_slots, e, kv,
                                        slots.capacity * size_of,
                                        e * slots.capacity * size_of, 0))  # (S, E, K)
        heads = op(ggml.ggml_mul_mat(context, values, probs))  # (E, T, H)
        heads = op(ggml.ggml_cont(context, view(ggml.ggml_permute(context, heads, 0, 2, 1, 3))))
        heads = view(ggml.ggml_reshape_2d(context, heads, e * h, t))  # (E*H, T)
        y = norm(product("wo", heads), "post_attention_norm")  # (D, T)
        h_out = op(ggml.ggml_add(context, y, x))  # (D, T)
        if not self.whole:
            return writes, [h_out]
        f = self.dense_ffn.nodes(context, arena, norm(h_out, "ffn_norm"))  # (D, T)
        if self.routed is not None:
            # the router sees rms_norm(h) / sqrt(D) * scale (gemma4.cpp)
            route_in = op(ggml.ggml_scale(context, norm(h_out, None), float(
                np.float32(1.0) / np.sqrt(np.float32(self.width)))))
            route_in = op(ggml.ggml_mul(context, route_in, vec["router_scale"]))
            ids, weights = self.router.nodes(context, arena, route_in, t)  # (P, T), (1, P, T)
            rows = norm(h_out, "pre_ffw_norm_2")  # (D, T)
            rows = view(ggml.ggml_reshape_3d(context, rows, self.width, 1, t))  # (D, 1, T)
            routed = self.routed.nodes(context, arena, "all", rows, ids, weights, t,
                                        self.router.top_k)  # (D, T)
            f = op(ggml.ggml_add(context, norm(f, "post_ffw_norm_1"),
                                 norm(routed, "post_ffw_norm_2")))
        out = op(ggml.ggml_add(context, norm(f, "post_ffw_norm"), h_out))  # (D, T)
        if "out_scale" in vec:
            out = op(ggml.ggml_mul(context, out, vec["out_scale"]))
        return writes, [out]
