"""The resident expert runner: every routed expert of every layer held stacked in memory.

This is the simplest ``ExpertRunner``; the offload work replaces it with a tiered store
behind the same ``run`` call. Weights are whatever the weight source returns: zero-copy views
of the mapped file for F32 GGUFs, decoded float32 otherwise.

Legend: N tokens, D model width, F expert width, X experts, K experts used per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ResidentExperts:
    def __init__(self, gate: dict[int, torch.Tensor], up: dict[int, torch.Tensor],
                 down: dict[int, torch.Tensor]):
        self.gate = gate  # layer -> [X, F, D]
        self.up = up  # layer -> [X, F, D]
        self.down = down  # layer -> [X, D, F]

    @classmethod
    def from_weights(cls, weights, layers: list[int]) -> "ResidentExperts":
        return cls({i: weights.experts(i, "gate") for i in layers},
                   {i: weights.experts(i, "up") for i in layers},
                   {i: weights.experts(i, "down") for i in layers})

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], expert_ids/weights [N, K] -> [N, D]: SwiGLU experts, weighted sum."""
        gate, up, down = self.gate[layer], self.up[layer], self.down[layer]
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()  # [N*K]
        order = torch.argsort(flat_ids, stable=True)  # [N*K] grouped by expert
        counts = torch.bincount(flat_ids, minlength=gate.shape[0]).tolist()  # [X]
        flat_weights = weights.flatten()  # [N*K]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start:start + count]  # [M] indices into N*K
            start += count
            tokens = slots // top_k  # [M]
            xs = x[tokens]  # [M, D]
            h = F.silu(F.linear(xs, gate[expert])) * F.linear(xs, up[expert])  # [M, F]
            y = F.linear(h, down[expert]) * flat_weights[slots, None]  # [M, D]
            out.index_add_(0, tokens, y)
        return out
