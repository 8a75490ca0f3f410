"""The float expert runner (every routed expert held stacked in memory; HF folders) and the
expert activations every runner shares.

GGUF experts of every type (F32 and MXFP4 included) are computed from their stored bytes by
``quant_experts``; the offload work replaces the runners with a tiered store behind the same
``run`` call. An expert is everything the router's pick computes with: gate,
up and down matrices plus, where the family has them, per-expert biases (GPT-OSS) and an
output scale (Gemma 4's per_expert_scale, llama.cpp's ffn_down_exps.scale). Weights are
whatever the weight source returns: decoded float32 for a folder, zero-copy views of the
mapped file where a test forces this runner onto an F32 GGUF.

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


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": swiglu, "gelu": geglu, "swiglu_oai": swiglu_oai}


@dataclass
class Expert:
    """One routed expert: matrices [F, D], [F, D], [D, F], optional biases [F], [F], [D] and
    an optional output scale (a 0-dim tensor)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """x [M, D] -> [M, D]."""
        h = ACTIVATIONS[activation](F.linear(x, self.gate, self.gate_bias),
                                    F.linear(x, self.up, self.up_bias))  # [M, F]
        y = F.linear(h, self.down, self.down_bias)  # [M, D]
        return y * self.scale if self.scale is not None else y


@dataclass
class LayerExtras:
    """A layer's small per-expert tensors, stacked: biases gate/up [X, F], down [X, D]; scale [X]."""

    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    @classmethod
    def from_weights(cls, weights: Any, layer: int) -> "LayerExtras":
        names = {"gate_bias": "ffn_gate_exps.bias", "up_bias": "ffn_up_exps.bias",
                 "down_bias": "ffn_down_exps.bias", "scale": "ffn_down_exps.scale"}
        return cls(**{field: weights.tensor(f"blk.{layer}.{name}")
                      for field, name in names.items() if weights.has(f"blk.{layer}.{name}")})

    def of(self, expert: int) -> dict[str, torch.Tensor]:
        """The keyword arguments of ``Expert`` that this expert has."""
        return {field: stacked[expert] for field, stacked in vars(self).items() if stacked is not None}


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
                 down: dict[int, torch.Tensor], extras: dict[int, LayerExtras] | None = None,
                 activation: str = "silu"):
        self.gate = gate  # layer -> [X, F, D]
        self.up = up  # layer -> [X, F, D]
        self.down = down  # layer -> [X, D, F]
        self.extras = extras or {}
        self.activation = activation

    @classmethod
    def from_weights(cls, weights, layers: list[int], activation: str = "silu") -> "ResidentExperts":
        return cls({i: weights.experts(i, "gate") for i in layers},
                   {i: weights.experts(i, "up") for i in layers},
                   {i: weights.experts(i, "down") for i in layers},
                   {i: LayerExtras.from_weights(weights, i) for i in layers}, activation)

    def expert(self, layer: int, expert: int) -> Expert:
        extras = self.extras.get(layer, LayerExtras())
        return Expert(self.gate[layer][expert], self.up[layer][expert], self.down[layer][expert],
                      **extras.of(expert))

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], expert_ids/weights [N, K] -> [N, D]."""
        return _run(lambda e: self.expert(layer, e), self.activation, x, expert_ids, weights)
