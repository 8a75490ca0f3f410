"""Router and MoE block. The block never holds routed experts: it asks an expert runner.

Routing per family (llama.cpp's build_moe_ffn): with gating "softmax" probabilities are the
softmax over all experts and the top-k are chosen; with "softmax_topk" (GPT-OSS) the top-k
logits are chosen and their softmax is the weights. Logits include the router bias when there
is one. Weights are renormalised to sum to 1 when the family says so, then multiplied by ``scale``. Shared experts run beside the routed
ones on every token, gated by sigmoid(w . x) in Qwen2-MoE and ungated in Granite-MoE-Shared.

The block hands each routing decision to a recorder when it was built with one
(moeswap.routing.recorder.RoutingRecorder); recording only reads the decision.

Legend: N tokens, D model width, X experts, K experts used per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from moeswap.models.blocks import DenseFFN


class ExpertRunner(Protocol):
    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[n, k] * expert_{ids[n, k]}(x[n]): x [N, D], ids/weights [N, K] -> [N, D]."""


class DecisionRecorder(Protocol):
    """What the engine tells a routing recorder: where each sequence's tokens sit in a forward's
    batch, then per MoE layer the batch's decisions (moeswap.routing.recorder.RoutingRecorder)."""

    router_probs: bool  # whether record() wants the full router distribution

    def begin_forward(self, spans: list[tuple[int, int]], starts: list[int], sequences: list) -> None:
        """Per sequence: its [start, end) rows of the batch, the position of its first new token,
        and an object that identifies it (its KV cache)."""

    def record(self, layer: int, expert_ids: torch.Tensor, weights: torch.Tensor,
               router_probs: torch.Tensor | None) -> None:
        """ids/weights [N, K] in batch row order; router_probs [N, X] or None."""


@dataclass
class Router:
    weight: torch.Tensor  # [X, D]
    top_k: int
    normalize: bool
    scale: float = 1.0
    bias: torch.Tensor | None = None  # [X] added to the logits (GPT-OSS)
    gating: str = "softmax"  # or "softmax_topk"

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (expert ids [N, K], weights [N, K])."""
        logits = self.logits(x)  # [N, X]
        if self.gating == "softmax_topk":
            top_logits, ids = torch.topk(logits, self.top_k, dim=-1)  # [N, K]
            weights = torch.softmax(top_logits, dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1)  # [N, X]
            weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [N, K]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return ids, weights.to(x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> float32 router logits [N, X] (with the bias)."""
        return F.linear(x, self.weight, self.bias).float()

    def report(self, recorder: DecisionRecorder, layer: int, x: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> None:
        """Hand this decision on x [N, D] to the recorder; the full softmax only when it asks
        (recomputed, so it costs nothing when not asked)."""
        probs = torch.softmax(self.logits(x), dim=-1) if recorder.router_probs else None  # [N, X]
        recorder.record(layer, ids, weights, probs)


@dataclass
class SharedExpert:
    ffn: DenseFFN
    gate: torch.Tensor | None = None  # [D]: output scaled by sigmoid(gate . x) (Qwen2-MoE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ffn(x)  # [N, D]
        if self.gate is not None:
            y = y * torch.sigmoid(x @ self.gate)[:, None]  # [N, 1]
        return y


@dataclass
class MoEBlock:
    layer: int
    router: Router
    experts: ExpertRunner
    shared: SharedExpert | None = None
    recorder: DecisionRecorder | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        ids, weights = self.router(x)
        if self.recorder is not None:
            self.router.report(self.recorder, self.layer, x, ids, weights)
        y = self.experts.run(self.layer, x, ids, weights)
        if self.shared is not None:
            y = y + self.shared(x)
        return y
