"""Token lookup as ggml computes it: ``get_rows`` on the stored table (quantized rows decoded by
ggml's own dequantizers), as llama.cpp starts a token's graph.

Its own graph per forward, or the start of a token graph (moeswap.models.token_graph): both
give the same rows. The table is bound where it lies, never decoded whole.

Legend (ggml order, ne0 first): D model width, N tokens, V vocabulary.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeswap.models.linear import QuantEmbedding, TorchEmbedding
from moeswap.quant import CpuKernels
from moeswap.quant.graph_arena import Arena, free_contexts, new_context

_F32, _I32 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.I32)
GROUP_TOKENS = 512  # tokens per lookup graph (a longer input takes several)
EMBEDDING_NODES = 4  # tensors and nodes ``nodes`` makes, with room
_KEPT = 8  # lookup graphs kept (one per group size seen last)
_FEW_IDS = 64  # ids checked in Python (one reduction through numpy costs more below this)


class EmbeddingGraph:
    """ids [N] -> rows [N, D] float32, before the model's embedding scale."""

    def __init__(self, kernels: CpuKernels, embedding: QuantEmbedding | TorchEmbedding):
        self.kernels, self.ggml = kernels, kernels.ggml
        if isinstance(embedding, QuantEmbedding):  # [V, row bytes] of the mapped file
            self._table = kernels.bind(embedding.rows, int(embedding.ggml_type),
                                       (embedding.width, embedding.rows.shape[0]), "token_embd")
        else:
            table = embedding.weight.detach().to(torch.float32).contiguous()  # [V, D]
            self._table = kernels.bind(table.numpy(), _F32, tuple(table.shape[::-1]),
                                       "token_embd")
        self.width, self.vocabulary = self._table.ne
        self._graphs: dict[int, tuple[int, int, int, int]] = {}  # N -> graph, context, in, out
        weakref.finalize(self, _free_kept, self.ggml, self._graphs)

    def nodes(self, context: int, arena: Arena, ids: int) -> int:
        """ids (N) I32 -> rows (D, N)."""
        return arena.op(self.ggml.ggml_get_rows(context, self._table.tensor, ids))

    def checked(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] as ggml takes them, int32 [N]; ValueError for an id outside the table
        (ggml would abort the process)."""
        ids = ids.reshape(-1).to(torch.int32).contiguous()  # [N]
        if ids.numel() <= _FEW_IDS:  # a decode step: Python's min/max beat numpy's call
            values = ids.tolist()
            bad = bool(values) and (min(values) < 0 or max(values) >= self.vocabulary)
        else:  # as unsigned, negative ids become huge: one reduction checks both ends
            bad = int(ids.numpy().view(np.uint32).max()) >= self.vocabulary
        if bad:
            raise ValueError(f"token ids must lie in [0, {self.vocabulary}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
        return ids

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> [N, D] float32."""
        ids = self.checked(ids)
        rows = torch.empty(ids.numel(), self.width)  # [N, D]
        for start in range(0, ids.numel(), GROUP_TOKENS):
            part, out = ids[start:start + GROUP_TOKENS], rows[start:start + GROUP_TOKENS]
            graph, _, source, result = self._graph(part.numel())
            self.kernels.run(graph, [(source, part.data_ptr(), part.nbytes)],
                             (out.data_ptr(), out.nbytes), result)
        return rows

    def _graph(self, n_tokens: int) -> tuple[int, int, int, int]:
        if n_tokens not in self._graphs:
            ggml = self.ggml
            context = new_context(ggml, EMBEDDING_NODES)
            arena = Arena(self.kernels, context)
            ids = arena.new(_I32, n_tokens)
            rows = self.nodes(context, arena, ids)
            graph = ggml.ggml_new_graph_custom(context, EMBEDDING_NODES, False)
            ggml.ggml_build_forward_expand(graph, rows)
            if len(self._graphs) == _KEPT:
                ggml.ggml_free(self._graphs.pop(next(iter(self._graphs)))[1])
            self._graphs[n_tokens] = (graph, context, arena.offsets[ids], arena.offsets[rows])
        return self._graphs[n_tokens]


def _free_kept(ggml, graphs: dict) -> None:
    free_contexts(ggml, [context for _, context, *_ in graphs.values()])
