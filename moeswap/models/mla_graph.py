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
``ffn_input``).

Legend (ggml order, ne0 first): D model width, H heads, P non-rotated and R rotated dims of a
query/key head, L kv_lora_rank, V value dims per head, Q q_lora_rank, C slots of the layer's
cache, S attended slots (C or a multiple of SLOT_SPAN), T tokens of a piece.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeswap.models.blocks import SLOT_SPAN, Batch, LayerStep, Rope
from moeswap.models.kv_graph_inputs import bind_cache, piece_inputs
from moeswap.models.linear import QuantHeads, QuantLinear, TorchHeads, TorchLinear
from moeswap.models.mla import MLAttention
from moeswap.quant import CpuKernels
from moeswap.quant.ggml_lib import InitParams
from moeswap.quant.graph_arena import Arena, free_contexts

MAX_PIECE_TOKENS = 512  # the most tokens one graph takes (llama.cpp's default ubatch)
GRAPH_BYTES = 160 << 20  # the most a piece's tensors may take of the scratch's 256 MiB
_KEPT_GRAPHS = 8  # graphs kept per layer and sequence (piece length, attended slots)
_N_TENSORS = 96  # of one graph (about 60 nodes and views)
_F32, _I32, _I64 = (int(GGMLQuantizationType[name]) for name in ("F32", "I32", "I64"))
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


class MlaLayerGraph:
    """A pre-norm MLA layer's attention with the norms and residual around it, computed by
    ggml: x [N, D], batch -> ``LayerStep`` (h, ffn_input); each sequence against its cache."""

    dense = experts = None  # the FFN stays the layer's (no token graph chains this one)

    def __init__(self, kernels: CpuKernels, attention: MLAttention, input_norm: torch.Tensor,
                 next_norm: torch.Tensor, eps: float):
        self.kernels, self.ggml, self.attention, self.eps = kernels, kernels.ggml, attention, eps
        a, w = attention, attention.w
        self.heads, self.nope, self.rot, self.rank = a.n_head, a.n_nope, a.n_rot, a.rank
        self.key_width = a.rank + a.n_rot  # L+R
        self._keep: list = []  # the bound tensors (their memory)
        self.matrices = {name: self._bind(p, name) for name, p in (
            ("wq", w.wq), ("wq_a", w.wq_a), ("wq_b", w.wq_b), ("wkv_a", w.wkv_a),
            ("wk_b", w.wk_b), ("wv_b", w.wv_b), ("wo", w.wo)) if p is not None}
        self.width = self.matrices["wkv_a"].ne[0]  # D
        self.value_width = self.matrices["wv_b"].ne[1]  # V
        self.vectors = {name: self._bind(v, name) for name, v in (
            ("input_norm", input_norm), ("next_norm", next_norm), ("kv_a_norm", w.kv_a_norm),
            ("q_a_norm", w.q_a_norm)) if v is not None}
        self.attn_factor, self.kq_scale = llama_cpp_scales(a.rope, a.spec.scale,
                                                           a.n_nope + a.n_rot)
        # Graphs die with the slots they write (a grown or finished cache frees its graphs).
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # of caches

    def _bind(self, source, name: str):
        """A weight as a ggml tensor: quantized ones as bound, float ones (F32 GGUF tensors,
        mapped) bound as F32 with ggml's shape, not copied: matrices [O, D] -> (D, O), head
        stacks [H, O, D] -> (D, O, H), vectors [n] -> (n, 1)."""
        if isinstance(source, QuantLinear):
            return source.matrix.weight
        if isinstance(source, QuantHeads):
            return source.stack.weight
        data = source.weight if isinstance(source, (TorchLinear, TorchHeads)) else source
        data = data.detach().to(torch.float32).contiguous()
        ne = tuple(data.shape[::-1]) if data.dim() > 1 else (data.numel(), 1)
        bound = self.kernels.bind(data.numpy(), _F32, ne, f"MLA {name}")
        self._keep.append(bound)
        return bound

    def __call__(self, x: torch.Tensor, batch: Batch) -> LayerStep:
        """x [N, D] -> h and the FFN's input [N, D], a graph per piece of each sequence."""
        x = x.to(torch.float32).contiguous()
        step = LayerStep(torch.empty(x.shape[0], self.width), torch.empty(x.shape[0], self.width))
        for (start, end), cache in zip(batch.spans, batch.caches):
            # keys [C, 1, L+R] and no values: the torch path's entries (MLAttention)
            slots = cache.room(self.attention.layer, end - start, (1, self.key_width), (1, 0))
            piece = self._piece_tokens(slots.capacity)
            for first in range(start, end, piece):
                last = min(first + piece, end)
                self._run(x[first:last], step, first, last, cache, slots,
                          cache.length + first - start, batch)
        return step

    def _piece_tokens(self, capacity: int) -> int:
        """Tokens per graph: as many as keep scores, probabilities and mask (S (2H+1)) and the
        per-head queries and results within GRAPH_BYTES (the copied values, S L, apart)."""
        per_token = 4 * (capacity * (2 * self.heads + 1) + 12 * self.width
                         + 4 * self.heads * (self.key_width + self.nope + self.value_width))
        return max(1, min(MAX_PIECE_TOKENS, (GRAPH_BYTES - 4 * capacity * self.rank) // per_token))

    def _run(self, x: torch.Tensor, step: LayerStep, row: int, end: int, cache, slots,
             first: int, batch: Batch) -> None:
        """x [T, D] at positions first.. -> rows row..end of the step; writes their keys."""
        n_new = x.shape[0]
        at = slots.claim(first, n_new)
        n_slots = min(slots.capacity, -(-max(slots.filled, 1) // SLOT_SPAN) * SLOT_SPAN)
        # Every MLA layer shares a piece's positions, slots and mask (value slots: none).
        key = ("mla", id(cache), slots.capacity, slots.base, slots.frontier, slots.filled,
               first, n_new)
        if key not in batch.shared:
            key_slots, _, mask = piece_inputs(slots, at, first, n_new, n_slots, 0, False, 1)
            batch.shared[key] = (torch.arange(first, first + n_new, dtype=torch.int32),
                                 key_slots, mask)
        graph, inputs, outputs = self._graph(slots, n_new, n_slots)
        data = (x, *batch.shared[key])
        h, ffn_input = step.h[row:end], step.ffn_input[row:end]
        self.kernels.run(graph, [(offset, t.data_ptr(), t.nbytes)
                                 for offset, t in zip(inputs, data)],
                         (h.data_ptr(), h.nbytes), outputs[0],
                         [(ffn_input.data_ptr(), ffn_input.nbytes, outputs[1])])

    def _graph(self, slots, n_new: int, n_slots: int) -> tuple:
        """The kept graph for T new tokens over S slots of these slots, built on first use;
        the last few live with the slots -> (graph, input offsets, output offsets)."""
        kept = self._graphs.get(slots)
        if kept is None:
            kept = self._graphs[slots] = {}
            weakref.finalize(slots, _free_kept, self.ggml, kept)
        graph = kept.pop((n_new, n_slots), None) or self._build(slots, n_new, n_slots)
        kept[(n_new, n_slots)] = graph  # most recent last
        if len(kept) > _KEPT_GRAPHS:
            free_contexts(self.ggml, [kept.pop(next(iter(kept)))[0]])
        return graph[1:]

    def _build(self, slots, n_new: int, n_slots: int) -> tuple:
        ggml = self.ggml
        size = (_N_TENSORS * ggml.ggml_tensor_overhead()
                + ggml.ggml_graph_overhead_custom(_N_TENSORS, False))
        context = ggml.ggml_init(InitParams(size, None, True))
        try:
            return (context, *self._fill(context, slots, n_new, n_slots))
        except BaseException:
            ggml.ggml_free(context)
            raise

    def _fill(self, context: int, slots, t: int, n_slots: int) -> tuple:
        """deepseek2.cpp's MLA branch for T = t tokens over S = n_slots slots, in ``context``
        -> (graph, input offsets of x, positions, key slots, mask; output offsets of h and
        the FFN's input)."""
        ggml, m, vec = self.ggml, self.matrices, self.vectors
        h, p, r, lat, kw = self.heads, self.nope, self.rot, self.rank, self.key_width
        arena = Arena(self.kernels, context)
        x = arena.new(_F32, self.width, t)  # (D, T)
        positions = arena.new(_I32, t)
        key_slots = arena.new(_I64, t)
        mask = arena.new(_F32, n_slots, t)  # (S, T)

        def op(tensor: int) -> int:
            return arena.op(tensor)

        def view(tensor: int) -> int:
            return arena.view(tensor)

        def norm(y: int, name: str) -> int:
            return op(ggml.ggml_mul(context, op(ggml.ggml_rms_norm(context, y, self.eps)),
                                    vec[name].tensor))

        def product(name: str, y: int) -> int:
            return op(ggml.ggml_mul_mat(context, m[name].tensor, y))

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
        q_nope = view(ggml.ggml_view_3d(context, q, p, h, t, (p + r) * 4, (p + r) * h * 4, 0))
        q_pe = rope(view(ggml.ggml_view_3d(context, q, r, h, t, (p + r) * 4, (p + r) * h * 4,
                                           p * 4)))  # (R, H, T)
        q_nope = view(ggml.ggml_permute(context, q_nope, 0, 2, 1, 3))  # (P, T, H)
        absorbed = product("wk_b", q_nope)  # (L, T, H)
        absorbed = view(ggml.ggml_permute(context, absorbed, 0, 2, 1, 3))  # (L, H, T)
        # Qcur and Kcur: llama.cpp's ggml_concat along ne0, as two copies into one tensor.
        queries = arena.new(_F32, kw, h, t)  # (L+R, H, T)
        keys_new = arena.new(_F32, kw, t)  # (L+R, T)
        copies = []
        for part, into, width, offset in (
                (absorbed, queries, lat, 0), (q_pe, queries, r, lat),
                (view(ggml.ggml_reshape_3d(context, latent, lat, 1, t)), keys_new, lat, 0),
                (k_pe, keys_new, r, lat)):
            rows = h if into == queries else 1
            copies.append(view(ggml.ggml_cpy(context, part, view(ggml.ggml_view_3d(
                context, into, width, rows, t, kw * 4, kw * rows * 4, offset * 4)))))
        cache_keys, _ = bind_cache(ggml, context, slots, kw, self._buffers)  # (L+R, C)
        write = view(ggml.ggml_set_rows(context, cache_keys, keys_new, key_slots))
        size_of = slots.keys.element_size()
        keys = view(ggml.ggml_view_3d(context, cache_keys, kw, n_slots, 1, kw * size_of,
                                      kw * size_of, 0))  # (L+R, S, 1)
        q_rows = view(ggml.ggml_permute(context, queries, 0, 2, 1, 3))  # (L+R, T, H)
        scores = op(ggml.ggml_mul_mat(context, keys, q_rows))  # (S, T, H)
        probs = op(ggml.ggml_soft_max_ext(context, scores, mask, self.kq_scale, 0.0))
        # the values: the latent part of the cached rows, transposed into (S, L, 1)
        values = view(ggml.ggml_view_3d(context, cache_keys, lat, n_slots, 1, kw * size_of,
                                        kw * size_of, 0))  # (L, S, 1)
        values = op(ggml.ggml_cont(context, view(ggml.ggml_permute(context, values, 1, 0, 2, 3))))
        heads = op(ggml.ggml_mul_mat(context, values, probs))  # (L, T, H)
        heads = product("wv_b", heads)  # (V, T, H)
        heads = op(ggml.ggml_cont(context, view(ggml.ggml_permute(context, heads, 0, 2, 1, 3))))
        heads = view(ggml.ggml_reshape_2d(context, heads, self.value_width * h, t))  # (V*H, T)
        h_out = op(ggml.ggml_add(context, product("wo", heads), x))  # (D, T)
        ffn_input = norm(h_out, "next_norm")  # (D, T)
        graph = ggml.ggml_new_graph_custom(context, _N_TENSORS, False)
        for node in (*copies, write, h_out, ffn_input):  # the cache written before it is read
            ggml.ggml_build_forward_expand(graph, node)
        return (graph, tuple(arena.offsets[i] for i in (x, positions, key_slots, mask)),
                (arena.offsets[h_out], arena.offsets[ffn_input]))


def _free_kept(ggml, kept: dict) -> None:
    """Free the contexts of kept graphs: values (context, graph, ...)."""
    free_contexts(ggml, [context for context, *_ in kept.values()])
