"""Expert runners: the resident one (every routed expert held stacked in memory) and one that
reads each expert's stored bytes when it is used (MXFP4 files), both computing the same math.

These are the simplest ``ExpertRunner``s; the offload work replaces them with a tiered store
behind the same ``run`` call. An expert is everything the router's pick computes with: gate,
up and down matrices plus, where the family has them, per-expert biases (GPT-OSS). Weights are
whatever the weight source returns: zero-copy views of the mapped file for F32 GGUFs, decoded
float32 otherwise.

Legend: N tokens, M tokens routed to one expert, D model width, F expert width, X experts,
K experts used per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

# GPT-OSS's clamped SwiGLU constants (llama.cpp hard-codes them for LLM_FFN_SWIGLU_OAI_MOE).
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: gate clamped above, up clamped both ways, gate * sigmoid(alpha gate) * (up + 1)."""
    gate = gate.clamp(max=OAI_LIMIT)
    up = up.clamp(-OAI_LIMIT, OAI_LIMIT)
    return gate * torch.sigmoid(OAI_ALPHA * gate) * (up + 1)


ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": swiglu, "swiglu_oai": swiglu_oai}


@dataclass
class Expert:
    """One routed expert: matrices [F, D], [F, D], [D, F] and optional biases [F], [F], [D]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """x [M, D] -> [M, D]."""
        h = ACTIVATIONS[activation](F.linear(x, self.gate, self.gate_bias),
                                    F.linear(x, self.up, self.up_bias))  # [M, F]
        return F.linear(h, self.down, self.down_bias)  # [M, D]


@dataclass
class LayerBiases:
    """A layer's per-expert biases, stacked: gate/up [X, F], down [X, D]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def from_weights(cls, weights: Any, layer: int) -> "LayerBiases | None":
        names = [f"blk.{layer}.ffn_{kind}_exps.bias" for kind in ("gate", "up", "down")]
        if not weights.has(names[0]):
            return None
        return cls(*(weights.tensor(name) for name in names))


def _run(fetch: Callable[[int], Expert], activation: str, x: torch.Tensor,
         expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [N, D], expert_ids/weights [N, K] -> [N, D]: each used expert once, weighted sum."""
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.flatten()  # [N*K]
    order = torch.argsort(flat_ids, stable=True)  # [N*K] grouped by expert
    used, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)  # [U]
    flat_weights = weights.flatten()  # [N*K]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(used.tolist(), counts.tolist()):
        slots = order[start:start + count]  # [M] indices into N*K
        start += count
        tokens = slots // top_k  # [M]
        y = fetch(expert)(x[tokens], activation) * flat_weights[slots, None]  # [M, D]
        out.index_add_(0, tokens, y)
    return out


class ResidentExperts:
    def __init__(self, gate: dict[int, torch.Tensor], up: dict[int, torch.Tensor],
                 down: dict[int, torch.Tensor], biases: dict[int, LayerBiases | None] | None = None,
                 activation: str = "silu"):
        self.gate = gate  # layer -> [X, F, D]
        self.up = up  # layer -> [X, F, D]
        self.down = down  # layer -> [X, D, F]
        self.biases = biases or {}
        self.activation = activation

    @classmethod
    def from_weights(cls, weights, layers: list[int], activation: str = "silu") -> "ResidentExperts":
        return cls({i: weights.experts(i, "gate") for i in layers},
                   {i: weights.experts(i, "up") for i in layers},
                   {i: weights.experts(i, "down") for i in layers},
                   {i: LayerBiases.from_weights(weights, i) for i in layers}, activation)

    def expert(self, layer: int, expert: int) -> Expert:
        b = self.biases.get(layer)
        return Expert(self.gate[layer][expert], self.up[layer][expert], self.down[layer][expert],
                      *((b.gate[expert], b.up[expert], b.down[expert]) if b else ()))

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], expert_ids/weights [N, K] -> [N, D]."""
        return _run(lambda e: self.expert(layer, e), self.activation, x, expert_ids, weights)


class OnUseExperts:
    """Decodes an expert from its stored bytes each time it is used; nothing is held in float32.

    For files whose experts are MXFP4: a float32 copy would be 8x their size. Only the used
    expert's bytes are read (``weights.expert``); the small per-expert biases stay resident.
    """

    def __init__(self, weights: Any, layers: list[int], activation: str = "silu"):
        self.weights = weights
        self.biases = {i: LayerBiases.from_weights(weights, i) for i in layers}
        self.activation = activation

    def expert(self, layer: int, expert: int) -> Expert:
        b = self.biases[layer]
        return Expert(*(self.weights.expert(layer, expert, kind) for kind in ("gate", "up", "down")),
                      *((b.gate[expert], b.up[expert], b.down[expert]) if b else ()))

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], expert_ids/weights [N, K] -> [N, D]."""
        return _run(lambda e: self.expert(layer, e), self.activation, x, expert_ids, weights)
