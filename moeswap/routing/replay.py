"""Replayed routing: a recorded trace's router decisions run instead of the model's own.

For measuring the expert store with real routing on a model whose router is not real (a
generated, randomly weighted file): ``moeswap run --replay-routing TRACE`` or
``moeswap.load(path, replay_routing=TRACE)``. docs/OFFLOAD.md ("Replayed routing") is the
specification; in short:

- layers: the trace's i-th traced layer drives the model's i-th MoE layer. A trace with more
  layers leaves the rest unused; one with fewer, another expert count or another k is refused.
- tokens: the replay stream is the trace's tokens in order (prompts back to back), keeping those
  recorded at every used layer (R rows). The token at position t of its sequence (0 = the first
  prompt token) gets row t mod R: a longer sequence wraps to the stream's start.
- weights: the trace's gate weights as recorded; where a (token, layer) lacks any, each of its
  k picks gets 1/k.

The model's router still runs and its answer is dropped, so timings include the router. A
recorder given beside the replay (``--trace``, the server's activity view) is handed the replayed
decisions, the ones that ran, without router probabilities.

Legend: N tokens of a forward's batch, K experts per token, R replay rows, L used layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moeswap.errors import MoeswapError
from moeswap.routing.traces import NO_EXPERT, RoutingTrace


class RoutingReplay:
    """One trace's decisions, fitted to one model by ``attach``.

    To the engine it is the DecisionRecorder: it learns the batch layout (``begin_forward``:
    which position each batch row holds) and passes the replayed decisions on to the recorder it
    wraps, if any; ``ReplayedExperts`` asks it for each MoE layer's decisions of those rows.
    """

    router_probs = False  # the DecisionRecorder interface: the router's distribution is not replayed

    def __init__(self, trace: RoutingTrace, path: str):
        self.trace, self.path = trace, path
        self.columns: dict[int, int] = {}  # model block index -> trace column
        self.ids = torch.zeros(0, 0, trace.k, dtype=torch.long)  # [R, L, K]
        self.weights = torch.zeros(0, 0, trace.k)  # [R, L, K]
        self.uniform_rows = 0  # rows with a layer whose weights the trace lacks (given 1/k)
        self.rows = torch.zeros(0, dtype=torch.long)  # [N] replay row of each batch row
        self.replaced = 0  # (token, layer) decisions replaced so far
        self.recorder = None  # handed the replayed decisions (moeswap.models.moe.DecisionRecorder)

    @classmethod
    def load(cls, path: str | Path) -> RoutingReplay:
        """Read a moeswap.trace.v1 file (docs/TRACES.md; import others with `moeswap import-trace`)."""
        return cls(RoutingTrace.load(path), str(path))

    def attach(self, config, model: str, experts, recorder):
        """Fit the trace to ``config`` (a ModelConfig of ``model``) and return what the engine is
        built with: (expert runner that replays, recorder), in place of (experts, recorder)."""
        self._fit(config, model)
        self.recorder = recorder
        return ReplayedExperts(experts, self), self

    def _fit(self, config, model: str) -> None:
        trace, layers = self.trace, list(config.moe_layers)
        fix = "record one from such a model (moeswap trace) or import one (moeswap import-trace)"
        if not layers:
            raise MoeswapError(f"{model}: this {config.arch} model has no routed experts; there is "
                               "no routing to replay (drop --replay-routing)")
        if trace.n_experts != config.n_expert:
            raise MoeswapError(f"{self.path}: the trace routes over {trace.n_experts} experts per "
                               f"layer, {model} has {config.n_expert}; replay a trace of a model "
                               f"with {config.n_expert} experts: {fix}")
        if trace.k != config.n_expert_used:
            raise MoeswapError(f"{self.path}: the trace picks {trace.k} experts per token, {model} "
                               f"uses {config.n_expert_used}; replay a trace of a top-"
                               f"{config.n_expert_used} model: {fix}")
        if trace.n_layers < len(layers):
            raise MoeswapError(f"{self.path}: the trace has {trace.n_layers} MoE layers, {model} has "
                               f"{len(layers)} (trace layer i drives MoE layer i); replay a trace "
                               f"with at least {len(layers)} layers: {fix}")
        ids = trace.expert_ids[:, :len(layers)]  # [T, L, K]
        weights = trace.weights[:, :len(layers)]  # [T, L, K]
        recorded = (ids != NO_EXPERT).all(axis=(1, 2))  # [T]
        if not recorded.any():
            raise MoeswapError(f"{self.path}: no token of the trace is recorded at all of its first "
                               f"{len(layers)} layers; there is nothing to replay: {fix}")
        ids, weights = ids[recorded], weights[recorded]  # [R, L, K]
        unknown = np.isnan(weights).any(axis=2, keepdims=True)  # [R, L, 1]
        self.uniform_rows = int(unknown.any(axis=(1, 2)).sum())
        self.ids = torch.from_numpy(ids.astype(np.int64))
        self.weights = torch.from_numpy(np.where(unknown, 1.0 / trace.k, weights).astype(np.float32))
        self.columns = {block: i for i, block in enumerate(layers)}

    @property
    def n_rows(self) -> int:
        return int(self.ids.shape[0])

    # -- the DecisionRecorder interface --------------------------------------------------------

    def begin_forward(self, spans: list[tuple[int, int]], starts: list[int], sequences: list) -> None:
        positions = [torch.arange(start, start + end - begin) for (begin, end), start in zip(spans, starts)]
        self.rows = torch.cat(positions) % self.n_rows  # [N]
        if self.recorder is not None:
            self.recorder.begin_forward(spans, starts, sequences)

    def record(self, layer: int, expert_ids, weights, router_probs) -> None:
        """Called with the model's own decisions, which are replaced: the wrapped recorder gets
        the replayed ones."""
        if self.recorder is not None:
            ids, replayed = self._lookup(layer, len(expert_ids))
            self.recorder.record(layer, ids, replayed.to(weights.dtype), None)

    # -- what ReplayedExperts asks ---------------------------------------------------------------

    def decisions(self, layer: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The trace's (expert ids [N, K], weights [N, K]) for this forward's rows at a model block."""
        self.replaced += n_tokens
        return self._lookup(layer, n_tokens)

    def _lookup(self, layer: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n_tokens != len(self.rows):
            raise RuntimeError(f"MoE layer {layer} got {n_tokens} tokens, the forward announced "
                               f"{len(self.rows)}")
        column = self.columns[layer]
        return self.ids[self.rows, column], self.weights[self.rows, column]

    def stats(self) -> dict:
        """What was replayed, for ``Runtime.stats()["routing"]``."""
        return {"mode": "replayed", "trace": self.path, "trace_model": self.trace.model,
                "trace_layers": self.trace.n_layers, "layers_used": len(self.columns),
                "rows": self.n_rows, "rows_skipped": self.trace.n_tokens - self.n_rows,
                "uniform_weight_rows": self.uniform_rows, "decisions": self.replaced}


class ReplayedExperts:
    """An expert runner that hands the wrapped runner (the store, or the resident experts) the
    trace's decisions in place of the router's."""

    def __init__(self, inner, replay: RoutingReplay):
        self.inner, self.replay = inner, replay

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D]; the router's expert_ids/weights [N, K] are ignored -> [N, D]."""
        ids, replayed = self.replay.decisions(layer, x.shape[0])  # [N, K]
        return self.inner.run(layer, x, ids, replayed.to(weights.dtype))


def routing_line(stats: dict) -> str:
    """The one line ``moeswap run`` prints about replayed routing."""
    return (f"routing: REPLAYED from {stats['trace']} ({stats['trace_model']}; trace layers "
            f"0-{stats['layers_used'] - 1} of {stats['trace_layers']}, {stats['rows']} tokens, "
            f"wrapping; {stats['uniform_weight_rows']} without weights given 1/k), "
            f"{stats['decisions']} decisions replaced: not the model's own routing")
