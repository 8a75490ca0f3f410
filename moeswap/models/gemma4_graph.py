"""A Gemma 4 layer's attention (moeswap.models.gemma4) as one ggml graph: the input norm, q/k/v
projections (the key projection as values where the layer has no attn_v), the q/k norms and
the weightless value norm, RoPE (proportional on global layers: rope_freqs), the KV cache
write, scores, softmax, values, the output projection, the post-attention norm and the
residual, in llama.cpp's ops and order (src/models/gemma4.cpp, llama-graph.cpp build_attn_mha
without flash attention), so that an f16 cache rounds what llama.cpp rounds. The FFN (dense
and routed) stays the layer's; it gets h. Pieces, kept graphs and their inputs:
moeswap.models.sequence_graph.

Legend (ggml order, ne0 first): D model width, H query heads, K kv heads, E head size, C slots
of the layer's cache, S attended slots, T tokens of a piece.
"""

from __future__ import annotations

import torch

from moeswap.models.blocks import Batch, Rope
from moeswap.models.gemma4 import Gemma4Attention, Gemma4Layer
from moeswap.models.kv_graph_inputs import bind_cache
from moeswap.models.linear import QuantLinear, TorchLinear
from moeswap.models.sequence_graph import SequenceGraph
from moeswap.quant import CpuKernels
from moeswap.quant.graph_arena import Arena

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
    """x [N, D], batch -> h = x + post_norm(attention(input_norm(x))) [N, D], each sequence
    against its own cache (the torch path's entries: keys and values [K, E])."""

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
        self.vectors = {name: self.bind(v, f"Gemma 4 {name}").tensor for name, v in (
            ("input_norm", layer.norms["attn_norm"]),
            ("post_norm", layer.norms["post_attention_norm"]), ("q_norm", a.q_norm),
            ("k_norm", a.k_norm), ("rope_freqs", a.rope.freq_factors)) if v is not None}

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [N, D] -> h [N, D]."""
        return super().__call__(x, batch)[0]

    def token_bytes(self, capacity: int) -> int:
        """Scores, probabilities and mask (S (2H+1)), q, k, v and the heads, a few (D)."""
        s = self.attention.spec
        return 4 * (capacity * (2 * s.n_head + 1) + 12 * self.width
                    + 6 * s.n_head * s.head_dim)

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
            return op(ggml.ggml_mul_mat(context, m[name].tensor, y))

        def rope(y: int) -> int:
            r = self.attention.rope
            return op(ggml.ggml_rope_ext(
                context, y, inputs["positions"], vec.get("rope_freqs"), r.n_rot,
                _ROPE_NEOX if r.neox else 0, 0, r.base, 1.0 / r.scale, 0.0, 1.0, 32.0, 1.0))

        xn = norm(x, "input_norm")  # (D, T)
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
        y = norm(product("wo", heads), "post_norm")  # (D, T)
        return writes, [op(ggml.ggml_add(context, y, x))]
