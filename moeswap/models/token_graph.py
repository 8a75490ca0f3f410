"""A short step of one or several sequences as one ggml graph: the token lookup, every layer's
nodes (its ``LayerGraph``: attention, routing, experts or dense FFN), chained, then the final
norm and the output head, the whole token as llama.cpp computes it (docs/KERNELS.md, "One graph
per step").

A graph per layer costs a compute call, copies in and out and the layer loop's Python per layer
and token; this is one call per step. It takes a step where every layer's FFN runs in its layer
graph (every expert in the mapped file, or a dense FFN), of at most ``PIECE_TOKENS`` new tokens
a sequence whose tensors fit the scratch; anything else runs layer by layer, with the same bits
(a layer's nodes are the same, so is the order ggml computes them in).

Graphs are built once per shape (tokens, each layer's slots and attended span); the model keeps
its last ``_KEPT``, freed as they age out (a graph's context holds every node: ~7 MiB for 48
layers).

Legend (ggml order, ne0 first): D model width, T new tokens of a sequence, N of all of them,
B sequences, V vocabulary.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from moeswap.models.blocks import SLOT_SPAN, KVCache
from moeswap.models.causal_lm import CausalLM
from moeswap.models.embedding_graph import EMBEDDING_NODES, EmbeddingGraph
from moeswap.models.ggml_attention import GRAPH_BYTES, PIECE_TOKENS, LayerGraph, shared_positions
from moeswap.models.head_graph import HEAD_NODES, HeadGraph
from moeswap.quant import CpuKernels
from moeswap.quant.graph_arena import Arena, new_context

_F32, _I32 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.I32)
_KEPT = 8  # graphs kept per model: a few shapes of each of a few caches


class TokenGraph:
    """Token ids and the sequences' caches -> logits (all rows, or each sequence's last), before
    the model's logit scale and soft-cap; writes the caches' keys and values."""

    def __init__(self, kernels: CpuKernels, embedding: EmbeddingGraph, embedding_scale: float,
                 layers: list, head: HeadGraph):
        self.kernels, self.ggml, self.head = kernels, kernels.ggml, head
        self.embedding, self.embedding_scale = embedding, embedding_scale
        self.layers = list(layers)  # with a ``graph`` (LayerGraph) each, ``ffn`` for reports
        self.graphs: list[LayerGraph] = [layer.graph for layer in layers]
        # (graph, context, routing offsets, the slots it writes) by shape, the last _KEPT
        self._kept: dict = {}
        weakref.finalize(self, _free_kept, self.ggml, self._kept)

    def rooms(self, lengths: list[int], caches: list[KVCache]) -> list | None:
        """Every layer's slots in every cache with room for these sequences' new tokens
        (layer by layer, each layer's sequences in order), where the step runs as one graph: at
        most PIECE_TOKENS each, every layer's tensors together within the scratch's
        GRAPH_BYTES; else None."""
        if max(lengths) > PIECE_TOKENS:
            return None
        n = sum(lengths)
        needed = n * (4 * self.head.vocabulary + 8 * self.head.width)  # the head's
        rooms = []
        for graph in self.graphs:
            for t, cache in zip(lengths, caches):
                slots = graph.room(cache, t)  # scores over the span attended, not the capacity
                attended = -(-(slots.filled + t) // SLOT_SPAN) * SLOT_SPAN
                needed += t * graph.token_bytes(slots, min(slots.capacity, attended))
                rooms.append(slots)
        return rooms if needed <= GRAPH_BYTES else None

    def __call__(self, ids: torch.Tensor, caches: list[KVCache], spans: list[tuple[int, int]],
                 rooms: list, last_only: bool) -> torch.Tensor:
        """Token ids [N], each sequence's rows ``spans`` [start, end) -> logits [N, V], or
        each sequence's last row's [B, V] with ``last_only``; ``rooms`` as ``rooms`` gave them.
        Reports each MoE layer's routing to its recorder."""
        n = ids.numel()
        pieces = tuple((cache.length, end - start) for cache, (start, end) in zip(caches, spans))
        shared: dict = {}  # each slot layout's inputs, made by its first layer
        inputs = [self.embedding.checked(ids), shared_positions(shared, pieces)]
        shapes, groups, room = [], {}, iter(rooms)
        for graph in self.graphs:
            for cache, (start, end), (first, t) in zip(caches, spans, pieces):
                slots = next(room)
                layout, n_slots = graph.claim(cache, slots, first, t, shared)
                if layout not in groups:
                    groups[layout] = len(groups)
                    inputs += shared[layout]  # key slots, value slots, mask
                shapes.append((slots, start, t, n_slots, groups[layout]))
        if last_only:
            inputs.append(torch.tensor([end - 1 for _, end in spans], dtype=torch.int32))  # [B]
        graph, outputs = self._graph(shapes, len(caches), last_only)
        logits = torch.empty(len(spans) if last_only else n, self.head.vocabulary)
        routing = [(layer, torch.empty(n, g.top_k, dtype=torch.int32), torch.empty(n, g.top_k))
                   for layer, g in zip(self.layers, self.graphs) if g.router is not None]
        more = [(t.data_ptr(), t.nbytes, offset) for (_, *tensors), offsets in zip(routing, outputs)
                for t, offset in zip(tensors, offsets)]
        self.kernels.run(graph.graph, [(offset, t.data_ptr(), t.nbytes)
                                       for offset, t in zip(graph.inputs, inputs)],
                         (logits.data_ptr(), logits.nbytes), graph.logits, more)
        for layer, ids, weights in routing:
            layer.ffn.report(None, ids, weights)
        return logits

    def _graph(self, shapes: list, n_sequences: int, last_only: bool):
        """The kept graph for this step's shapes (built on first use; the model keeps its last
        _KEPT, whichever caches they write) and the scratch offsets of each MoE layer's (ids,
        weights)."""
        kept = self._kept
        key = (last_only, tuple((id(slots), *shape) for slots, *shape in shapes))
        entry = kept.pop(key, None)
        if entry is not None and any(ref() is not slots
                                     for ref, (slots, *_) in zip(entry[3], shapes)):
            self.ggml.ggml_free(entry[1])  # a slots object died and another took its id
            entry = None
        if entry is None:
            entry = (*self._build(shapes, n_sequences, last_only),
                     [weakref.ref(slots) for slots, *_ in shapes])
        kept[key] = entry  # most recent last
        if len(kept) > _KEPT:
            self.ggml.ggml_free(kept.pop(next(iter(kept)))[1])
        return entry[0], entry[2]

    def _build(self, shapes: list, n_sequences: int, last_only: bool):
        """-> the graph (its input offsets, ``logits``' offset), its context and the MoE layers'
        (ids, weights) offsets, for shapes (slots, first row, T, S, layout group), a layer's
        sequences one after the other."""
        ggml = self.ggml
        n = sum(t for _, _, t, _, _ in shapes[:n_sequences])
        n_nodes = EMBEDDING_NODES + HEAD_NODES + sum(g.n_nodes(n_sequences, n, True)
                                                     for g in self.graphs)
        context = new_context(ggml, n_nodes)
        try:
            arena = Arena(self.kernels, context)
            ids = arena.new(_I32, n)
            positions = arena.new(_I32, n)
            inputs, layouts, routing = [ids, positions], {}, []
            x = self.embedding.nodes(context, arena, ids)  # (D, N)
            if self.embedding_scale != 1.0:
                x = arena.op(ggml.ggml_scale(context, x, self.embedding_scale))
            graph = ggml.ggml_new_graph_custom(context, n_nodes, False)
            for i, layer_graph in enumerate(self.graphs):
                pieces = shapes[i * n_sequences:(i + 1) * n_sequences]
                outputs, writes = layer_graph.nodes(context, arena, x, positions, pieces, True,
                                                    inputs, layouts)
                for tensor in (*writes, outputs["out"]):  # a layer's writes before its scores
                    ggml.ggml_build_forward_expand(graph, tensor)
                x = outputs["out"]  # (D, N)
                if "ids" in outputs:
                    picks = (outputs["ids"], outputs["weights"])
                    routing.append(tuple(arena.offsets[t] for t in picks))
                    for tensor in picks:
                        ggml.ggml_build_forward_expand(graph, tensor)
            if last_only:  # each sequence's last column (D, B)
                last = arena.new(_I32, n_sequences)
                inputs.append(last)
                x = arena.op(ggml.ggml_get_rows(context, x, last))
            logits = self.head.nodes(context, arena, x)  # (V, N or B)
            ggml.ggml_build_forward_expand(graph, logits)
            built = _Built(graph, tuple(arena.offsets[t] for t in inputs), arena.offsets[logits])
            return built, context, routing
        except BaseException:
            ggml.ggml_free(context)
            raise


@dataclass
class _Built:
    graph: int
    inputs: tuple[int, ...]  # scratch offsets of the ids, positions, each layout's three
    #                          inputs, then (last_only) each sequence's last row
    logits: int  # scratch offset of the logits


def attach(model: CausalLM, kernels: CpuKernels) -> TokenGraph | None:
    """The model's token graph, where every layer's FFN runs in its layer graph and the head
    has its graph (else None: such models run layer by layer)."""
    if model.head_graph is None or not isinstance(model.embedding, EmbeddingGraph) or not all(
            getattr(layer, "graph", None) is not None
            and (layer.graph.dense is not None or layer.graph.experts is not None)
            for layer in model.layers):
        return None
    return TokenGraph(kernels, model.embedding, model.config.embedding_scale, model.layers,
                      model.head_graph)


def _free_kept(ggml, kept: dict) -> None:
    for _, context, *_ in kept.values():
        ggml.ggml_free(context)
