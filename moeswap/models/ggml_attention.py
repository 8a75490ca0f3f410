"""A layer as one ggml graph: the input norm, projections, q/k norms, RoPE, the KV cache write,
scores, softmax, values, the output projection, the residual and the FFN's norm, then the
router and, where every expert lies in the mapped file, the routed experts, as llama.cpp builds
them (docs/KERNELS.md, "One graph per layer").

The torch code of ``moeswap.models.blocks.Attention`` makes a dozen torch calls and four ggml
graphs per layer and token; this makes one graph per piece of a sequence (up to
``MAX_PIECE_TOKENS`` tokens, fewer where its tensors would outgrow the scratch), built once
per (piece length, attended slots) and kept with the cache's slots.
The graph mirrors llama.cpp's attention without flash attention (llama-cpp-python's default):
``rope_ext``; ``set_rows`` into the cache (values transposed, llama.cpp's v_trans); scores
``mul_mat(k, q)`` over whole spans of ``SLOT_SPAN`` slots with a -inf mask for slots
not visible from a query (unwritten, later, outside the window); ``soft_max_ext``;
``mul_mat(v, probs)`` (moeswap.models.slot_attention; with repacked layouts one token reads
each cached row once for the query heads that share it). With an f16 cache ggml rounds q and
the probabilities to f16 before each product, as llama.cpp does, where the torch reference
emulates that rounding. A Q8_0 cache (``--kv-type q8_0``) keeps values as rows, not
transposed (a Q8_0 block is 32 numbers of a row), and attends with ``flash_attn_ext`` and an
f16 mask, as llama.cpp's flash attention, the only way llama.cpp takes a quantized V.

What ggml is not asked to do keeps the torch path (moeswap.models.graph_support says which).

Legend (ggml order, ne0 first): D model width, H query heads, K kv heads, E head size, C slots
of the layer's cache, S attended slots (C or a multiple of SLOT_SPAN), T tokens of a piece.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeswap.models.blocks import SLOT_SPAN, Attention, Batch, LayerStep
from moeswap.models.ggml_ffn import DenseFfnGraph, bound_matrix
from moeswap.models.graph_routing import GraphRouter
from moeswap.models.graph_support import graph_routes, supports
from moeswap.models.kv_graph_inputs import bind_cache, piece_inputs
from moeswap.models.slot_attention import attend
from moeswap.models import gemma4_graph, mla_graph
from moeswap.models.moe import MoEBlock, Router
from moeswap.models.quant_experts import QuantResidentExperts
from moeswap.models.sequence_graph import GRAPH_BYTES, MAX_PIECE_TOKENS
from moeswap.quant import MAX_TOKENS_PER_CALL, CpuKernels
from moeswap.quant.graph_arena import Arena, new_context
from moeswap.quant.moe_graph import MoeFfn
from moeswap.quant.q8_0_kernel import PRODUCT_NODES, matrix_product

PIECE_TOKENS = 32  # a piece of a long input is a multiple of this; several sequences: at most
_SLOT_GRAPHS = 8  # graphs kept per layer and sequence (piece length, attended slots)
_BATCH_GRAPHS = 4  # graphs of several sequences kept per layer (the last compositions)
_PRODUCTS = 12  # dense products of a layer at most (MLA's projections, a dense FFN)
_F32, _F16, _I32, _I64 = (int(GGMLQuantizationType[name]) for name in ("F32", "F16", "I32", "I64"))
_ROPE_NEOX = 2  # GGML_ROPE_TYPE_NEOX; 0 is llama.cpp's NORM layout
# Expert types ggml's CPU mul_mat_id computes by vec_dot alone, a token's bits its own
_VEC_DOT_TYPES = frozenset(GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", "Q8_0"))


@dataclass
class AroundAttention:
    """A pre-norm layer's tensors around its attention: x -> h = x + post(attn(input(x))) * scale,
    then next(h), the FFN's input (PreNormLayer; Gemma 3's SandwichLayer adds ``post``)."""

    input_norm: torch.Tensor  # [D]
    next_norm: torch.Tensor  # [D]
    eps: float
    post_norm: torch.Tensor | None = None  # [D]
    residual_scale: float = 1.0
    router: Router | None = None  # routing in the graph too (``graph_routes``)
    experts: MoeFfn | None = None  # and the routed experts, then the layer's whole output
    dense: DenseFfnGraph | None = None  # or its dense FFN, then the whole output too
    post_ffn_norm: torch.Tensor | None = None  # [D] on the FFN's output (Gemma 3)
    # whether the experts' products are a token's own whatever tokens share a product (else in
    # the store's groups of MAX_TOKENS_PER_CALL tokens: ``group_free``)
    any_group: bool = False


def attach(layers: list, kernels: CpuKernels) -> None:
    """Give each pre-norm layer whose attention ``supports`` allows its graph (``layer.graph``,
    x -> ``LayerStep``). A MoE layer with a plain softmax router routes in the graph; one whose
    experts all lie in the mapped file (no shared expert, no recorder of full distributions)
    computes them there too, as a dense layer its FFN."""
    for layer in layers:
        attention = getattr(layer, "attention", None)
        if hasattr(layer, "graph") and isinstance(attention, Attention) and supports(attention):
            moe = layer.ffn if isinstance(layer.ffn, MoEBlock) else None
            router = moe.router if moe is not None and graph_routes(moe.router) else None
            whole = (router is not None and moe.shared is None and not moe.weight_input
                     and (moe.recorder is None or not moe.recorder.router_probs)
                     and isinstance(moe.experts, QuantResidentExperts))
            around = AroundAttention(layer.attn_norm, layer.ffn_norm, layer.eps,
                                     getattr(layer, "post_attn_norm", None),
                                     getattr(layer, "residual_scale", 1.0), router,
                                     moe.experts.fused(moe.layer) if whole else None,
                                     getattr(layer.ffn, "graph", None),
                                     getattr(layer, "post_ffn_norm", None),
                                     whole and group_free(moe.experts, moe.layer, kernels))
            layer.graph = LayerGraph(kernels, attention, around)
    for own in (mla_graph, gemma4_graph):  # attentions with graphs of their own
        own.attach(layers, kernels)


def group_free(experts: QuantResidentExperts, layer: int, kernels: CpuKernels) -> bool:
    """Whether a piece's tokens may share one expert product: where ggml's mul_mat_id gives a
    token the same bits in any group (vec_dot types), or tiers need not agree bit for bit
    (repacked layouts, no --exact-tiers). A K-quant token's product depends on its group
    (ggml's tiled path), so exact tiers keep the store's 32-token groups."""
    return kernels.repack or all(part.ggml_type in _VEC_DOT_TYPES
                                 for part in experts.layouts[layer].matrices.values())


@dataclass
class _Graph:
    graph: int
    inputs: tuple[int, ...]  # scratch offsets of x, positions, then per piece its key slots,
    #                          value slots and mask
    outputs: dict[str, int]  # LayerStep field -> scratch offset


class LayerGraph:
    """A layer's attention with the norms and residual around it (and its routing and experts,
    where ``AroundAttention`` has them), computed by ggml: x [N, D], batch -> ``LayerStep``."""

    def __init__(self, kernels: CpuKernels, attention: Attention, around: AroundAttention):
        self.kernels, self.ggml, self.attention = kernels, kernels.ggml, attention
        self.residual_scale = around.residual_scale
        self.router, self.experts, self.dense = around.router, around.experts, around.dense
        self.any_group = around.any_group
        self.top_k = around.router.top_k if around.router is not None else 0
        w, s = attention.w, attention.spec
        self.kv_width = s.n_head_kv * s.head_dim  # K*E
        self._entry_shape = (s.n_head_kv, s.head_dim)  # of a slot's keys and of its values
        self.vectors: dict[str, int] = {}  # biases, norm weights, rope factors as F32 tensors
        self._keep: list = []  # the bound vectors' memory
        self.matrices = {name: bound_matrix(kernels, linear, f"attention {name}")
                         for name, linear in (("wq", w.wq), ("wk", w.wk), ("wv", w.wv),
                                              ("wo", w.wo))}
        self.width, self.eps = self.matrices["wq"].ne[0], around.eps  # D
        self.routing = GraphRouter(kernels, self.router) if self.router is not None else None
        for name, vector in (("bq", w.wq.bias), ("bk", w.wk.bias), ("bv", w.wv.bias),
                             ("bo", w.wo.bias), ("q_norm", w.q_norm), ("k_norm", w.k_norm),
                             ("input_norm", around.input_norm), ("post_norm", around.post_norm),
                             ("next_norm", around.next_norm),
                             ("post_ffn_norm", around.post_ffn_norm),
                             ("rope_freqs", attention.rope.freq_factors)):
            if vector is not None:
                flat = vector.detach().to(torch.float32).contiguous().reshape(-1)
                bound = kernels.bind(flat.numpy(), _F32, (flat.numel(), 1), f"attention {name}")
                self.vectors[name] = bound.tensor
                self._keep.append(bound)
        # Graphs die with the slots they write (a grown or finished cache frees its graphs).
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # of caches
        self._batch_graphs: dict = {}  # several sequences' pieces -> graph, context, their slots
        weakref.finalize(self, _free_kept, kernels.ggml, self._batch_graphs)

    def __call__(self, x: torch.Tensor, batch: Batch) -> LayerStep:
        """x [N, D] -> the layer's ``LayerStep``; each sequence against its own cache. One
        sequence: a graph per piece, computing its FFN (dense or routed) too where it can.
        Several sequences of at most PIECE_TOKENS new tokens each (decode steps) whose graph
        fits the scratch: one graph for all, their projections and routing batched, each
        attending its own cache, the experts then computed once for all (each expert read once
        per step); else one sequence after another."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        rooms = [self.room(cache, end - start) for (start, end), cache in zip(batch.spans,
                                                                               batch.caches)]
        if len(batch.spans) > 1 and all(end - start <= PIECE_TOKENS
                                        for start, end in batch.spans) and sum(
                (end - start) * self.token_bytes(slots)
                for (start, end), slots in zip(batch.spans, rooms)) <= GRAPH_BYTES:
            step = self._outputs(x.shape[0], False)
            pieces = [(cache, slots, start, end, cache.length)
                      for (start, end), cache, slots in zip(batch.spans, batch.caches, rooms)]
            self._run(x, step, 0, x.shape[0], pieces, batch, False)
            return step
        pieces = [self._piece_tokens(slots) for slots in rooms]
        # The routed experts join a piece's graph where a token's product is its own in any
        # group, or where its pieces keep the 32-token groups the store computes.
        fused = len(batch.spans) == 1 and (self.dense is not None or self.experts is not None
                                           and (self.any_group
                                                or pieces[0] % MAX_TOKENS_PER_CALL == 0
                                                or x.shape[0] <= pieces[0]))
        step = self._outputs(x.shape[0], fused)
        for (start, end), cache, slots, piece in zip(batch.spans, batch.caches, rooms, pieces):
            for first in range(start, end, piece):
                last = min(first + piece, end)
                self._run(x[first:last], step, first, last,
                          [(cache, slots, 0, last - first, cache.length + first - start)],
                          batch, fused)
        return step

    def room(self, cache, n_new: int):
        """The layer's slots in ``cache`` with room for n_new more positions."""
        return cache.room(self.attention.layer, n_new, self._entry_shape, self._entry_shape)

    def token_bytes(self, slots, attended: int = 0) -> int:
        """An upper bound on the scratch bytes one new token of a graph takes: scores and
        probabilities (S, H) and the mask (S), S the ``attended`` slots (0: the capacity); the
        dense FFN's tensors (F: 11 with tanh GELU, 3 with SiLU) or the experts' (F, K) x 3 and
        (D, K) x 3; a few (D)."""
        s = self.attention.spec
        ffn = 0
        if self.dense is not None:
            ffn = self.dense.hidden_width * (11 if self.dense.gelu else 3)
        elif self.experts is not None:
            ffn = 3 * self.top_k * (self.experts.hidden_width + self.width)
        return 4 * ((attended or slots.capacity) * (2 * s.n_head + 1) + ffn + 12 * self.width
                    + 4 * s.n_head * s.head_dim)

    def _piece_tokens(self, slots) -> int:
        """Tokens per graph for a sequence's long input: as many as keep the graph within
        GRAPH_BYTES, whole multiples of PIECE_TOKENS where that many fit, at most
        MAX_PIECE_TOKENS: fewer graphs, each weight read once a piece."""
        fits = GRAPH_BYTES // self.token_bytes(slots)
        if fits < PIECE_TOKENS:
            return max(1, fits)
        return min(MAX_PIECE_TOKENS, fits // PIECE_TOKENS * PIECE_TOKENS)

    def _outputs(self, n: int, fused: bool) -> LayerStep:
        step = (LayerStep(out=torch.empty(n, self.width)) if fused
                else LayerStep(torch.empty(n, self.width), torch.empty(n, self.width)))
        if self.router is not None:
            step.ids = torch.empty(n, self.top_k, dtype=torch.int32)
            step.weights = torch.empty(n, self.top_k)
        return step

    def _run(self, x: torch.Tensor, step: LayerStep, row: int, end: int, pieces: list,
             batch: Batch, fused: bool) -> None:
        """x [T, D] -> rows row..end of the step's outputs, for pieces (cache, slots, their
        rows start..stop of x, the position of the first) of one or several sequences;
        writes their keys and values."""
        spans = tuple((first, stop - start) for _, _, start, stop, first in pieces)
        inputs, shapes = [x, shared_positions(batch.shared, spans)], []
        for cache, slots, start, stop, first in pieces:
            layout, n_slots = self.claim(cache, slots, first, stop - start, batch.shared)
            inputs += batch.shared[layout]  # key slots, value slots, mask
            shapes.append((slots, start, stop - start, n_slots))
        graph = self._graph(shapes, fused)
        outputs = [(getattr(step, name)[row:end], offset) for name, offset in graph.outputs.items()]
        self.kernels.run(graph.graph, [(offset, t.data_ptr(), t.nbytes)
                                       for offset, t in zip(graph.inputs, inputs)],
                         (outputs[0][0].data_ptr(), outputs[0][0].nbytes), outputs[0][1],
                         [(t.data_ptr(), t.nbytes, offset) for t, offset in outputs[1:]])

    def claim(self, cache, slots, first: int, n_new: int, shared: dict) -> tuple[tuple, int]:
        """Claim the slots of a piece's positions first.. -> (its layout, S): the piece's key
        slots, value slots and mask are ``shared[layout]``, made by the first layer of that
        slot layout in this forward (the others read the same)."""
        s = self.attention.spec
        at = slots.claim(first, n_new)
        n_slots = min(slots.capacity, -(-max(slots.filled, 1) // SLOT_SPAN) * SLOT_SPAN)
        layout = (id(cache), s.window, s.chunked, self.kv_width, slots.capacity, slots.base,
                  slots.frontier, slots.filled, first, n_new)
        if layout not in shared:
            shared[layout] = piece_inputs(slots, at, first, n_new, n_slots, s.window, s.chunked,
                                          self.kv_width)
        return layout, n_slots

    def _graph(self, shapes: list, fused: bool) -> _Graph:
        """The kept graph for these pieces (slots, first row, T, S), built on first use: the
        last few of one sequence's graphs live with its slots; a graph of several sequences is
        kept while all of their slots live, the last few compositions only."""
        if len(shapes) == 1:
            slots, _, n_new, n_slots = shapes[0]
            kept = self._graphs.get(slots)
            if kept is None:
                kept = self._graphs[slots] = {}
                weakref.finalize(slots, _free_kept, self.ggml, kept)
            key = (n_new, n_slots, fused)
            graph = kept.pop(key, None) or self._build(shapes, fused)
            kept[key] = graph  # most recent last
            if len(kept) > _SLOT_GRAPHS:
                self.ggml.ggml_free(kept.pop(next(iter(kept)))[1])
            return graph[0]
        key = tuple((id(slots), start, n_new, n_slots) for slots, start, n_new, n_slots in shapes)
        kept = self._batch_graphs.pop(key, None)
        if kept is None or any(ref() is not slots for ref, (slots, *_) in zip(kept[2], shapes)):
            if kept is not None:
                self.ggml.ggml_free(kept[1])
            kept = (*self._build(shapes, fused), [weakref.ref(slots) for slots, *_ in shapes])
        self._batch_graphs[key] = kept  # most recent last
        while len(self._batch_graphs) > _BATCH_GRAPHS:
            self.ggml.ggml_free(self._batch_graphs.pop(next(iter(self._batch_graphs)))[1])
        return kept[0]

    def _build(self, shapes: list, fused: bool) -> tuple[_Graph, int]:
        """The graph for pieces (slots, first row, T_i, S_i): the projections, norms, RoPE
        and routing over all N = sum T_i tokens, each piece attending the first S_i slots of
        its own cache -> the graph and its context."""
        ggml, n = self.ggml, sum(t for _, _, t, _ in shapes)
        n_nodes = self.n_nodes(len(shapes), n, fused)
        context = new_context(ggml, n_nodes)
        try:
            arena = Arena(self.kernels, context)
            x = arena.new(_F32, self.width, n)  # (D, N)
            positions = arena.new(_I32, n)
            inputs = [x, positions]
            outputs, writes = self.nodes(context, arena, x, positions,
                                         [(*shape, None) for shape in shapes], fused, inputs, {})
            graph = ggml.ggml_new_graph_custom(context, n_nodes, False)
            for write in writes:  # first: the scores read the slots they fill, the sum its parts
                ggml.ggml_build_forward_expand(graph, write)
            for tensor in outputs.values():
                ggml.ggml_build_forward_expand(graph, tensor)
            offsets = {name: arena.offsets[tensor] for name, tensor in outputs.items()}
            return _Graph(graph, tuple(arena.offsets[i] for i in inputs), offsets), context
        except BaseException:
            ggml.ggml_free(context)
            raise

    def n_nodes(self, n_pieces: int, n_tokens: int, fused: bool) -> int:
        """At most how many tensors (and nodes) ``nodes`` makes for n_pieces pieces of
        n_tokens tokens in all."""
        groups = 0 if not fused or self.experts is None else (
            1 if self.any_group else -(-n_tokens // MAX_TOKENS_PER_CALL))
        return (160 + _PRODUCTS * (PRODUCT_NODES - 1) + 8 * self.top_k + 48 * n_pieces
                + groups * (48 + 6 * self.top_k))

    def nodes(self, context: int, arena: Arena, x: int, positions: int, shapes: list,
              fused: bool, inputs: list, layouts: dict) -> tuple[dict[str, int], list[int]]:
        """The layer's nodes on x (D, N) at positions (N) for pieces (slots, first row, T, S,
        layout) -> its outputs by ``LayerStep`` field and the cache writes, to expand before
        them. Each piece's key slots, value slots and mask are new tensors appended to
        ``inputs``, or, where ``layouts`` already holds the piece's layout (not None), those
        of an earlier layer of a token graph."""
        ggml, a, s = self.ggml, self.attention, self.attention.spec
        e, h, kv = s.head_dim, s.n_head, s.n_head_kv
        n = sum(t for _, _, t, _, _ in shapes)
        vec = self.vectors

        def norm(y: int, name: str, eps: float) -> int:
            normed = arena.op(ggml.ggml_rms_norm(context, y, eps))
            return arena.op(ggml.ggml_mul(context, normed, vec[name]))

        def residual(base: int, y: int) -> int:
            """base + y times the residual multiplier (Granite), (D, N)."""
            if self.residual_scale != 1.0:
                y = arena.op(ggml.ggml_scale(context, y, self.residual_scale))
            return arena.op(ggml.ggml_add(context, base, y))

        xn = norm(x, "input_norm", self.eps)  # (D, N)

        def project(name: str, bias: str) -> int:
            y = matrix_product(self.kernels, context, arena, self.matrices[name], xn)  # (O, N)
            return arena.op(ggml.ggml_add(context, y, vec[bias])) if bias in vec else y

        def rope(y: int) -> int:
            r = a.rope
            return arena.op(ggml.ggml_rope_ext(
                context, y, positions, vec.get("rope_freqs"), r.n_rot,
                _ROPE_NEOX if r.neox else 0, 0, r.base, 1.0 / r.scale, 0.0, 1.0, 32.0, 1.0))

        q_all, k_all, v_all = project("wq", "bq"), project("wk", "bk"), project("wv", "bv")
        whole = a.w.q_norm is not None and a.w.q_norm.shape[0] != e
        if whole:  # OLMoE: over the whole projection
            q_all, k_all = norm(q_all, "q_norm", s.eps), norm(k_all, "k_norm", s.eps)
        q_all = arena.view(ggml.ggml_reshape_3d(context, q_all, e, h, n))  # (E, H, N)
        k_all = arena.view(ggml.ggml_reshape_3d(context, k_all, e, kv, n))  # (E, K, N)
        if a.w.q_norm is not None and not whole:  # per head
            q_all, k_all = norm(q_all, "q_norm", s.eps), norm(k_all, "k_norm", s.eps)
        q_all, k_all = rope(q_all), rope(k_all)
        if s.scale_q:
            q_all = arena.op(ggml.ggml_scale(context, q_all, s.scale))
        writes = []
        # each piece's heads (E*H, T) go into its columns of all N tokens' (several pieces)
        all_heads = arena.new(_F32, e * h, n) if len(shapes) > 1 else None
        for slots, start, t, n_slots, layout in shapes:
            cache_keys, cache_values = bind_cache(ggml, context, slots, self.kv_width,
                                                   self._buffers)
            if layout is None or layout not in layouts:
                made = (arena.new(_I64, t), arena.new(_I64, t if slots.rows else t * self.kv_width),
                        arena.new(_F16 if slots.rows else _F32, n_slots, t))  # mask (S, T)
                inputs += made
                if layout is not None:
                    layouts[layout] = made
            key_slots, value_slots, mask = made if layout is None else layouts[layout]
            # This piece's columns of the batch: q (E, H, T), k and v (K*E, T) rows.
            q = arena.view(ggml.ggml_view_3d(context, q_all, e, h, t, e * 4, e * h * 4,
                                             start * e * h * 4))
            k_rows = arena.view(ggml.ggml_view_2d(context, k_all, self.kv_width, t,
                                                  self.kv_width * 4, start * self.kv_width * 4))
            v_rows = arena.view(ggml.ggml_view_2d(context, v_all, *(
                (self.kv_width, t, self.kv_width * 4) if slots.rows
                else (1, t * self.kv_width, 4)), start * self.kv_width * 4))
            # The new keys and values into their slots (keys (K*E, C) rows; values one number
            # per row of the transposed (1, C*K*E) view, as llama.cpp writes v_trans, or
            # (K*E, C) rows of a Q8_0 cache, which set_rows quantizes as llama.cpp's cpy_k and
            # cpy_v do).
            for write in (ggml.ggml_set_rows(context, cache_keys, k_rows, key_slots),
                          ggml.ggml_set_rows(context, cache_values, v_rows, value_slots)):
                writes.append(arena.view(write))  # its data is the cache itself
            heads = attend(ggml, context, arena, q, t, (cache_keys, cache_values), slots, mask,
                           n_slots, s, self.kernels.repack)  # (E, H, T) or (E, H / K, K)
            heads = arena.view(ggml.ggml_reshape_2d(context, heads, e * h, t))  # (E*H, T)
            if all_heads is not None:
                writes.append(_into_columns(ggml, context, arena, all_heads, heads, e * h, start,
                                            t))
        heads, t = (heads if all_heads is None else all_heads), n
        y = matrix_product(self.kernels, context, arena, self.matrices["wo"], heads)  # (D, T)
        if "bo" in vec:
            y = arena.op(ggml.ggml_add(context, y, vec["bo"]))
        if "post_norm" in vec:
            y = norm(y, "post_norm", self.eps)
        h = residual(x, y)  # (D, T)
        ffn_input = norm(h, "next_norm", self.eps)  # (D, T)
        outputs = {"h": h, "ffn_input": ffn_input}
        if fused and self.dense is not None:
            y = self.dense.nodes(context, arena, ffn_input)  # (D, T)
            if "post_ffn_norm" in vec:
                y = norm(y, "post_ffn_norm", self.eps)
            outputs = {"out": residual(h, y)}  # (D, T)
        if self.router is not None:
            ids, weights = self.routing.nodes(context, arena, ffn_input, t)  # (K, T), (1, K, T)
            outputs.update(ids=ids, weights=weights)
            if fused:
                y, copies = self._experts(context, arena, ffn_input, ids, weights, t)
                writes += copies
                outputs = {"out": residual(h, y),  # (D, T)
                           "ids": ids, "weights": weights}  # for the routing recorder
        return outputs, writes

    def _experts(self, context: int, arena: Arena, x: int, ids: int, weights: int,
                 n_tokens: int) -> tuple[int, list[int]]:
        """The routed experts on x (D, T) -> (D, T) and the copies that fill it: all T tokens in
        one product where ``any_group``, else in groups of MAX_TOKENS_PER_CALL tokens, the
        groups the store and the resident runner compute (run_in_pieces), since a token's
        product can depend on the others in its group (docs/KERNELS.md, K-quants). Each
        group's result is copied into its columns."""
        ggml, d, k = self.ggml, self.width, self.top_k
        group = n_tokens if self.any_group else MAX_TOKENS_PER_CALL
        out = arena.new(_F32, d, n_tokens) if n_tokens > group else None
        copies = []
        for start in range(0, n_tokens, group):
            t = min(group, n_tokens - start)
            rows = arena.view(ggml.ggml_view_3d(context, x, d, 1, t, d * 4, d * 4, start * d * 4))
            picks = arena.view(ggml.ggml_view_2d(context, ids, k, t, k * 4, start * k * 4))
            share = arena.view(ggml.ggml_view_3d(context, weights, 1, k, t, 4, k * 4,
                                                 start * k * 4))
            y = self.experts.nodes(context, arena, "all", rows, picks, share, t, k)  # (D, t)
            if out is None:
                return y, []
            copies.append(_into_columns(ggml, context, arena, out, y, d, start, t))
        return out, copies


def shared_positions(shared: dict, spans: tuple) -> torch.Tensor:
    """The positions [T] of pieces (first position, length), made once per forward (every
    layer feeds the same)."""
    if spans not in shared:
        shared[spans] = torch.from_numpy(np.concatenate([
            np.arange(first, first + n, dtype=np.int32) for first, n in spans]))  # [T]
    return shared[spans]


def _into_columns(ggml, context: int, arena: Arena, out: int, part: int, rows: int,
                  start: int, n_columns: int) -> int:
    """Copy ``part`` (R = rows, n_columns) f32 into columns start.. of ``out`` (R, N) -> the
    copy's node, to expand before anything that reads ``out``."""
    columns = arena.view(ggml.ggml_view_2d(context, out, rows, n_columns, rows * 4,
                                           start * rows * 4))
    return arena.view(ggml.ggml_cpy(context, part, columns))


def _free_kept(ggml, kept: dict) -> None:
    """Free the contexts of kept graphs: values (graph, context, ...)."""
    for _, context, *_ in kept.values():
        ggml.ggml_free(context)
