"""Router and MoE block. The block never holds routed experts: it asks an expert runner.

Routing per family (llama.cpp's build_moe_ffn): with gating "softmax" probabilities are the
softmax over all experts and the top-k are chosen; "sigmoid" (DeepSeek-V3, Kimi-K2) takes each
expert's sigmoid instead; with "softmax_topk" (GPT-OSS) the top-k logits are chosen and their
softmax is the weights. Logits include the router bias when there is one. DeepSeek-V3 adds a
selection bias (``exp_probs_b``) to the probabilities for choosing experts only, and may limit
the choice to the best groups of experts (``select_groups``); the weights stay the unbiased
probabilities of the chosen experts. transformers' Phi-3.5-MoE ("sparsemixer") picks the top 2
logits and weighs each by a softmax over the logits near it (``sparsemixer_weights``). Weights
are renormalised to sum to 1 when the family says so, then multiplied by ``scale``. Llama 4
weights each expert's input instead of its output (``weight_input``: expert(w * x), llama.cpp's
weight_before_ffn). Shared experts run beside the routed ones on every token, gated by
sigmoid(w . x) in Qwen2-MoE and ungated in Granite-MoE-Shared.

The block hands each routing decision to a recorder when it was built with one
(moeswap.routing.recorder.RoutingRecorder); recording only reads the decision.

Legend: N tokens, D model width, X experts, K experts used per token, G expert groups.
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
    gating: str = "softmax"  # or "sigmoid", "softmax_topk", "sparsemixer"
    selection_bias: torch.Tensor | None = None  # [X] added to the probabilities to choose (DeepSeek-V3)
    groups: tuple[int, int] = (0, 0)  # (groups, groups kept): group-limited choice; 0: none
    jitter_eps: float = 0.0  # sparsemixer: logits within 2 * jitter_eps (relative) share a weight

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (expert ids [N, K], weights [N, K])."""
        logits = self.logits(x)  # [N, X]
        if self.gating == "softmax_topk":
            top_logits, ids = torch.topk(logits, self.top_k, dim=-1)  # [N, K]
            weights = torch.softmax(top_logits, dim=-1)
        elif self.gating == "sparsemixer":
            ids = torch.topk(logits, self.top_k, dim=-1).indices  # [N, K]
            weights = sparsemixer_weights(logits, ids, self.jitter_eps)
        elif self.selection_bias is None and self.groups[0] <= 1:
            probs = self.gate(logits)  # [N, X]
            weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [N, K]
        else:
            probs = self.gate(logits)  # [N, X]
            choice = probs if self.selection_bias is None else probs + self.selection_bias  # [N, X]
            if self.groups[0] > 1:
                choice = select_groups(choice, *self.groups)
            ids = torch.topk(choice, self.top_k, dim=-1).indices  # [N, K]
            weights = probs.gather(1, ids)  # [N, K]: unbiased
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return ids, weights.to(x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> float32 router logits [N, X] (with the bias)."""
        return F.linear(x, self.weight, self.bias).float()

    def gate(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, X] -> each expert's probability [N, X]: softmax, or sigmoid per expert."""
        return torch.sigmoid(logits) if self.gating == "sigmoid" else torch.softmax(logits, dim=-1)

    def report(self, recorder: DecisionRecorder, layer: int, x: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> None:
        """Hand this decision on x [N, D] to the recorder; the full distribution (softmax, or
        the sigmoid scores) only when it asks (recomputed, so it costs nothing when not asked)."""
        probs = self.gate(self.logits(x)) if recorder.router_probs else None  # [N, X]
        recorder.record(layer, ids, weights, probs)


def select_groups(choice: torch.Tensor, n_group: int, n_used: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited choice: experts split into n_group equal groups, a group
    scores the sum of its best two choice scores, and experts outside the n_used best groups
    drop to -inf (llama.cpp's build_moe_ffn; transformers' n_group / topk_group).
    choice [N, X] -> [N, X]."""
    grouped = choice.view(choice.shape[0], n_group, -1)  # [N, G, X/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
    kept = group_scores.topk(n_used, dim=-1).indices  # [N, n_used]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [N, G]
    return grouped.masked_fill(~mask[:, :, None], float("-inf")).view_as(choice)  # [N, X]


def sparsemixer_weights(logits: torch.Tensor, ids: torch.Tensor, jitter_eps: float) -> torch.Tensor:
    """transformers' sparsemixer at inference (Phi-3.5-MoE): pick k is weighted by the softmax,
    over the logits not yet picked, of those within a relative 2 * jitter_eps of its own logit;
    about 1 each unless logits nearly tie. logits [N, X], ids [N, K] (the top-k) -> [N, K]."""
    remaining = logits.clone()  # [N, X]
    weights = []
    for k in range(ids.shape[1]):
        pick = ids[:, k:k + 1]  # [N, 1]
        top = remaining.gather(1, pick)  # [N, 1]
        far = (top - logits) / logits.abs().clamp(min=top) > 2 * jitter_eps  # [N, X]
        near = torch.softmax(remaining.masked_fill(far, float("-inf")), dim=-1)  # [N, X]
        weights.append(near.gather(1, pick))
        remaining = remaining.scatter(1, pick, float("-inf"))
    return torch.cat(weights, dim=-1)  # [N, K]


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
    weight_input: bool = False  # each expert computes expert(w * x), unweighted after (Llama 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        return self.routed(x, *self.router(x))

    def report(self, x: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Hand the recorder (if any) this choice on x [N, D]; x may be None where the recorder
        takes no full distributions (a layer graph that ran the experts itself)."""
        if self.recorder is not None:
            self.router.report(self.recorder, self.layer, x, ids, weights)

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D] with the router's choice made (ids, weights [N, K]) -> [N, D]."""
        self.report(x, ids, weights)
        if self.weight_input:  # one run per choice k: its input scaled by its own weight
            ones = torch.ones_like(weights[:, :1])  # [N, 1]
            y = sum(self.experts.run(self.layer, x * weights[:, k:k + 1], ids[:, k:k + 1], ones)
                    for k in range(ids.shape[1]))
        else:
            y = self.experts.run(self.layer, x, ids, weights)
        if self.shared is not None:
            y = y + self.shared(x)
        return y
