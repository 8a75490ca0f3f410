"""What the attention graphs of layers outside ``ggml_attention.LayerGraph`` share (MLA:
moeswap.models.mla_graph; Gemma 4: moeswap.models.gemma4_graph): one graph per piece of one
sequence at a time, built on first use per (piece length, attended slots) and kept with the
cache's slots, fed x, the positions, the slots the new tokens go to and the mask of what each
query sees. A subclass gives the nodes (``nodes``) and a bound on a token's bytes.

Legend (ggml order, ne0 first): D model width, C slots of the layer's cache, S attended slots
(C or a multiple of SLOT_SPAN), T tokens of a piece, K*E numbers of a slot's keys (values too).
"""

from __future__ import annotations

import weakref

import torch
from gguf import GGMLQuantizationType

from moeswap.models.blocks import SLOT_SPAN, Batch
from moeswap.models.kv_graph_inputs import piece_inputs
from moeswap.quant import CpuKernels
from moeswap.quant.graph_arena import Arena, free_contexts, new_context
from moeswap.quant.q8_0_kernel import PRODUCT_NODES

MAX_PIECE_TOKENS = 512  # the most tokens one graph takes (llama.cpp's default ubatch)
GRAPH_BYTES = 160 << 20  # the most a piece's tensors may take of the scratch's 256 MiB
_KEPT_GRAPHS = 8  # graphs kept per layer and sequence (piece length, attended slots)
F32, I32, I64 = (int(GGMLQuantizationType[name]) for name in ("F32", "I32", "I64"))


class SequenceGraph:
    """A layer's graph over one sequence's cache: x [N, D], batch -> ``n_outputs`` tensors
    [N, D]; each sequence's tokens in pieces of at most MAX_PIECE_TOKENS."""

    dense = experts = None  # the FFN stays the layer's (no token graph chains these)
    n_tensors = 128 + 8 * (PRODUCT_NODES - 1)  # of one graph (nodes and views; 8 products)
    max_piece = MAX_PIECE_TOKENS  # tokens of one graph, at most

    def __init__(self, kernels: CpuKernels, layer: int, width: int, n_outputs: int,
                 key_shape: tuple[int, ...], value_shape: tuple[int, ...], window: int = 0):
        """key_shape, value_shape: a slot's entries ([K, E]; the torch path's, which shares
        the cache); window: the layer's sliding window (0: none)."""
        self.kernels, self.ggml, self.layer, self.width = kernels, kernels.ggml, layer, width
        self.n_outputs, self.window = n_outputs, window
        self.key_shape, self.value_shape = key_shape, value_shape
        self.value_numbers = value_shape[0] * value_shape[1]  # K*E; 0: no values are stored
        self._keep: list = []  # the bound weights' memory
        # Graphs die with the slots they write (a grown or finished cache frees its graphs).
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # of caches

    def token_bytes(self, capacity: int) -> int:
        """An upper bound on the scratch bytes one new token takes over ``capacity`` slots."""
        raise NotImplementedError

    def nodes(self, context: int, arena: Arena, slots, inputs: dict[str, int], t: int,
              n_slots: int) -> tuple[list[int], list[int]]:
        """The graph's nodes on ``inputs`` (x (D, T), positions, key_slots, value_slots,
        mask (S, T)) -> (nodes to compute first, such as the cache writes; the outputs)."""
        raise NotImplementedError

    def bind(self, data: torch.Tensor, name: str):
        """A float weight bound as F32 with ggml's shape, not copied where it is already
        contiguous float32 (F32 GGUF tensors, mapped): [O, D] -> (D, O), [H, O, D] ->
        (D, O, H), a vector [n] -> (n, 1)."""
        data = data.detach().to(torch.float32).contiguous()
        ne = tuple(data.shape[::-1]) if data.dim() > 1 else (data.numel(), 1)
        bound = self.kernels.bind(data.numpy(), F32, ne, name)
        self._keep.append(bound)
        return bound

    def __call__(self, x: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
        x = x.to(torch.float32).contiguous()
        outputs = [torch.empty(x.shape[0], self.width) for _ in range(self.n_outputs)]
        for (start, end), cache in zip(batch.spans, batch.caches):
            slots = cache.room(self.layer, end - start, self.key_shape, self.value_shape)
            fits = (GRAPH_BYTES - 4 * slots.keys[0].numel() * slots.capacity
                    ) // self.token_bytes(slots.capacity)
            piece = max(1, min(self.max_piece, fits))
            for first in range(start, end, piece):
                last = min(first + piece, end)
                self._run(x[first:last], [out[first:last] for out in outputs], cache, slots,
                          cache.length + first - start, batch)
        return outputs

    def _run(self, x: torch.Tensor, outputs: list[torch.Tensor], cache, slots, first: int,
             batch: Batch) -> None:
        """x [T, D] at positions first.. -> outputs [T, D]; writes their keys and values."""
        n_new = x.shape[0]
        at = slots.claim(first, n_new)
        n_slots = min(slots.capacity, -(-max(slots.filled, 1) // SLOT_SPAN) * SLOT_SPAN)
        # Every such layer of this slot layout shares a piece's positions, slots and mask.
        key = ("sequence", id(cache), self.window, self.value_numbers, slots.capacity,
               slots.base, slots.frontier, slots.filled, first, n_new)
        if key not in batch.shared:
            batch.shared[key] = (torch.arange(first, first + n_new, dtype=torch.int32),
                                 *piece_inputs(slots, at, first, n_new, n_slots, self.window,
                                               False, max(self.value_numbers, 1)))
        graph, offsets, out_offsets = self._graph(slots, n_new, n_slots)
        data = (x, *batch.shared[key])  # x, positions, key slots, value slots, mask
        self.kernels.run(graph, [(offset, t.data_ptr(), t.nbytes)
                                 for offset, t in zip(offsets, data)],
                         (outputs[0].data_ptr(), outputs[0].nbytes), out_offsets[0],
                         [(out.data_ptr(), out.nbytes, offset)
                          for out, offset in zip(outputs[1:], out_offsets[1:])])

    def _graph(self, slots, n_new: int, n_slots: int) -> tuple:
        """The kept graph for T new tokens over S of these slots, built on first use; the last
        few live with the slots -> (graph, input offsets, output offsets)."""
        kept = self._graphs.get(slots)
        if kept is None:
            kept = self._graphs[slots] = {}
            weakref.finalize(slots, _free_kept, self.ggml, kept)
        graph = kept.pop((n_new, n_slots), None) or self._build(slots, n_new, n_slots)
        kept[(n_new, n_slots)] = graph  # most recent last
        if len(kept) > _KEPT_GRAPHS:
            free_contexts(self.ggml, [kept.pop(next(iter(kept)))[0]])
        return graph[1:]

    def _build(self, slots, t: int, n_slots: int) -> tuple:
        """-> (context, graph, input offsets, output offsets)."""
        ggml = self.ggml
        context = new_context(ggml, self.n_tensors)
        try:
            arena = Arena(self.kernels, context)
            value_slots = t * self.value_numbers if self.value_numbers else t
            inputs = {"x": arena.new(F32, self.width, t), "positions": arena.new(I32, t),
                      "key_slots": arena.new(I64, t), "value_slots": arena.new(I64, value_slots),
                      "mask": arena.new(F32, n_slots, t)}
            first, outputs = self.nodes(context, arena, slots, inputs, t, n_slots)
            graph = ggml.ggml_new_graph_custom(context, self.n_tensors, False)
            for node in (*first, *outputs):  # the cache written before it is read
                ggml.ggml_build_forward_expand(graph, node)
            return (context, graph, tuple(arena.offsets[i] for i in inputs.values()),
                    tuple(arena.offsets[i] for i in outputs))
        except BaseException:
            ggml.ggml_free(context)
            raise


def _free_kept(ggml, kept: dict) -> None:
    """Free the contexts of kept graphs: values (context, graph, ...)."""
    free_contexts(ggml, [context for context, *_ in kept.values()])
