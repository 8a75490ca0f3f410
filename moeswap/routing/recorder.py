"""RoutingRecorder: the engine hands it every router decision; ``trace()`` turns them into a trace.

The engine calls it explicitly (moeswap.models.moe.DecisionRecorder): ``CausalLM.forward`` says
where each sequence's new tokens sit in the batch (``begin_forward``), then every MoE block hands
over its layer's decisions for the whole batch (``record``). Give it to the engine when loading:
``moeswap.load(path, recorder=RoutingRecorder())``.

Recording only keeps references to the router's small output tensors (one list append per layer
per forward); slicing the batch into sequences and converting happen once, in ``trace()``. The
references stay until ``clear()``: about K x 12 bytes plus ~0.2 KB of tensor overhead per
forward, token and MoE layer.

A sequence is identified by the KV cache it runs with: a cache at position 0 starts a new
sequence; a later forward on the same cache continues it. A sequence's tokens are *prefill*
unless they are a single token appended to a non-empty cache (a decode step), as
moeswap.generate runs them.

Legend: N tokens of a forward's batch, K experts chosen per token, X experts per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeswap.routing.traces import RoutingTrace, TraceBuilder


@dataclass(frozen=True)
class _Span:
    sequence: int  # index in order of first appearance
    rows: tuple[int, int]  # [start, end) of the batch
    position: int  # position of the first of these tokens within the sequence
    phase: str  # "prefill" or "decode"
    forward: int  # the forward pass, numbered from 0 since the last clear()


class RoutingRecorder:
    """Collects the engine's routing decisions; ``router_probs`` also keeps each token's full
    router distribution (softmax over all experts' logits, [X] per token and layer)."""

    def __init__(self, router_probs: bool = False):
        self.router_probs = router_probs
        self.clear()

    def clear(self) -> None:
        """Forget everything recorded so far."""
        self._n_sequences = 0
        self._n_forwards = 0
        self._sequence_of: dict[int, int] = {}  # id(cache) -> sequence, for continuing sequences
        self._layout: list[_Span] = []  # the current forward's sequences
        self._records: list[tuple[list[_Span], int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    @property
    def n_sequences(self) -> int:
        return self._n_sequences

    def begin_forward(self, spans: list[tuple[int, int]], starts: list[int], sequences: list) -> None:
        layout = []
        for rows, start, cache in zip(spans, starts, sequences):
            sequence = self._sequence_of.get(id(cache)) if start > 0 else None
            if sequence is None:  # a fresh cache (or one this recorder never saw): a new sequence
                sequence = self._n_sequences
                self._n_sequences += 1
                self._sequence_of[id(cache)] = sequence
            decode = start > 0 and rows[1] - rows[0] == 1
            layout.append(_Span(sequence, (rows[0], rows[1]), start, "decode" if decode else "prefill",
                                self._n_forwards))
        self._layout = layout
        self._n_forwards += 1

    def record(self, layer: int, expert_ids: torch.Tensor, weights: torch.Tensor,
               router_probs: torch.Tensor | None) -> None:
        """expert_ids, weights [N, K] and router_probs [N, X] (or None) in batch row order."""
        self._records.append((self._layout, layer, expert_ids, weights, router_probs))

    def trace(self, *, model: str, arch: str, layers: list[int], n_experts: int, k: int,
              prompt_names: list[str] | None = None, source: str = "") -> RoutingTrace:
        """Everything recorded since the last ``clear()`` as a trace: one prompt per sequence, in
        the order the sequences first reached the engine, named by ``prompt_names``."""
        if prompt_names is not None and len(prompt_names) != self._n_sequences:
            raise ValueError(f"{len(prompt_names)} prompt names for {self._n_sequences} recorded sequences")
        per_sequence: list[list[tuple]] = [[] for _ in range(self._n_sequences)]
        for layout, layer, ids, weights, probs in self._records:
            ids_np = ids.cpu().numpy()  # [N, K]
            weights_np = weights.float().cpu().numpy()  # [N, K]
            probs_np = None if probs is None else probs.float().cpu().numpy()  # [N, X]
            for span in layout:
                a, b = span.rows
                per_sequence[span.sequence].append(
                    (layer, span.position, ids_np[a:b], weights_np[a:b],
                     None if probs_np is None else probs_np[a:b], span.phase, span.forward))
        builder = TraceBuilder(model=model, arch=arch, layers=layers, n_experts=n_experts, k=k, source=source)
        for sequence, chunks in enumerate(per_sequence):
            builder.begin_prompt(prompt_names[sequence] if prompt_names else "")
            for layer, position, ids, weights, probs, phase, forward in chunks:
                builder.append(layer, position, ids, weights, router_probs=probs, phase=phase,
                               forward=forward)
        return builder.build()
