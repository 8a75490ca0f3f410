"""Router and MoE block. The block never holds routed experts: it asks an expert runner.

Routing per family (llama.cpp's build_moe_ffn): with gating "softmax" probabilities are the
softmax over all experts and the top-k are chosen; with "softmax_topk" (GPT-OSS) the top-k
logits are chosen and their softmax is the weights. Logits include the router bias when there
is one. Weights are renormalised to sum to 1 when the family says so, then multiplied by ``scale``. Shared experts run beside the routed
ones on every token, gated by sigmoid(w . x) in Qwen2-MoE and ungated in Granite-MoE-Shared.

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
        logits = F.linear(x, self.weight, self.bias).float()  # [N, X]
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        ids, weights = self.router(x)
        y = self.experts.run(self.layer, x, ids, weights)
        if self.shared is not None:
            y = y + self.shared(x)
        return y
