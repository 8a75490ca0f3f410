"""Routed experts computed by ggml from their stored bytes, and the math every such runner shares.

A layer's routed experts are stored as stacks (GGUF ne ``(in, out, E)``): gate and up, or one
fused gate_up (gate rows first), then down, plus per-expert bias vectors in some families
(GPT-OSS) and a per-expert output scale (Gemma 4, ffn_down_exps.scale). ``ExpertLayout`` describes where one expert's pieces lie in the file; the unit an
offload store moves is all of them together.

``routed_forward`` is the one place the MoE math happens, given a ``project`` function that
computes an expert part for every (token, pick). The resident runner here projects through whole
stacks in the mapped file; the offload store projects each expert from wherever its bytes are.
Both give bit-identical logits because ggml's ``mul_mat_id`` multiplies each expert's tokens as
one group whatever stack holds the expert (docs/KERNELS.md, "Exactness across tiers"), and
because both cut the batch into the same pieces of at most ``MAX_TOKENS_PER_CALL`` tokens and run
the same torch code on the same shapes afterwards.

Legend: N tokens, T tokens of one piece, K experts picked per token, D model width,
F expert width, O a part's output width, X experts in the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from moeswap.errors import MoeswapError
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models.experts import ACTIVATIONS
from moeswap.quant import MAX_TOKENS_PER_CALL, CpuKernels, QuantExperts

_VECTOR_DTYPES = {0: torch.float32, 1: torch.float16}  # ggml type id -> torch dtype (biases)


@dataclass(frozen=True)
class ExpertPart:
    """One piece of every expert of a layer: a matrix stack (ne in, out, X) or a bias stack (out, X)."""

    name: str  # the stacked tensor's name
    ggml_type: int
    ne: tuple[int, ...]  # one expert's shape: (in, out) for a matrix, (out,) for a bias
    n_experts: int
    data_start: int  # absolute file offset of expert 0
    expert_bytes: int  # bytes of one expert's piece; expert e starts at data_start + e * expert_bytes

    @property
    def is_matrix(self) -> bool:
        return len(self.ne) == 2

    @property
    def out_features(self) -> int:
        return self.ne[-1]


@dataclass(frozen=True)
class ExpertLayout:
    """Where a layer's experts lie: matrix parts (``gate_up`` or ``gate``, ``up``; ``down``)
    and vector parts: biases keyed by the matrix they follow, ``scale`` the output scale."""

    layer: int
    matrices: dict[str, ExpertPart]
    biases: dict[str, ExpertPart]

    @property
    def n_experts(self) -> int:
        return self.matrices["down"].n_experts

    @property
    def fused(self) -> bool:
        return "gate_up" in self.matrices

    @property
    def parts(self) -> list[ExpertPart]:
        return [*self.matrices.values(), *self.biases.values()]

    @property
    def expert_bytes(self) -> int:
        """All of one expert's stored bytes: the unit of residency."""
        return sum(p.expert_bytes for p in self.parts)

    @classmethod
    def from_file(cls, gguf: GGUFFile, layer: int) -> "ExpertLayout":
        def part(name: str, dims: int) -> ExpertPart | None:
            info = gguf.tensor(name)
            if info is None:
                return None
            if len(info.shape) != dims or info.n_bytes % info.shape[-1]:
                raise MoeswapError(f"{gguf.path}: '{name}' has shape {list(info.shape)}, expected "
                                   f"{dims} dimensions with the expert index last")
            n_experts = info.shape[-1]
            return ExpertPart(name, int(info.type_id), tuple(info.shape[:-1]), n_experts,
                              info.data_start, info.n_bytes // n_experts)

        p = f"blk.{layer}.ffn_"
        kinds = ("gate_up", "down") if gguf.tensor(p + "gate_up_exps.weight") else ("gate", "up", "down")
        matrices = {}
        for kind in kinds:
            found = part(f"{p}{kind}_exps.weight", 3)
            if found is None:
                raise MoeswapError(f"{gguf.path}: tensor '{p}{kind}_exps.weight' is missing; "
                                   "the file is incomplete or not of this architecture")
            matrices[kind] = found
        biases = {k: b for k in kinds if (b := part(f"{p}{k}_exps.bias", 2)) is not None}
        if (scale := part(f"{p}down_exps.scale", 1)) is not None:  # one number per expert
            biases["scale"] = scale
        for b in biases.values():
            if b.ggml_type not in _VECTOR_DTYPES:
                raise MoeswapError(f"{gguf.path}: '{b.name}' must be F32 or F16 to be used as a bias")
        return cls(layer, matrices, biases)


# project(kind, x [T, in] or [T, K, in], ids [T, K]) -> [T, K, O]: one matrix part of the
# picked experts; bias(kind, ids [T, K]) -> [T, K, O].
Project = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
Bias = Callable[[str, torch.Tensor], torch.Tensor]


def routed_forward(layout: ExpertLayout, project: Project, bias: Bias, activation: str,
                   x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [N, D], expert_ids/weights [N, K] -> sum_k weights * expert(x) [N, D]."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], MAX_TOKENS_PER_CALL):
        end = min(start + MAX_TOKENS_PER_CALL, x.shape[0])
        out[start:end] = _piece(layout, project, bias, activation, x[start:end],
                                expert_ids[start:end], weights[start:end])
    return out


def _piece(layout: ExpertLayout, project: Project, bias: Bias, activation: str,
           x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The same, for at most MAX_TOKENS_PER_CALL tokens: x [T, D], ids/weights [T, K] -> [T, D]."""
    def matrix(kind: str, inputs: torch.Tensor) -> torch.Tensor:
        y = project(kind, inputs, ids)  # [T, K, O]
        return y + bias(kind, ids) if kind in layout.biases else y

    if layout.fused:
        gate_up = matrix("gate_up", x)  # [T, K, 2F]
        half = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :half], gate_up[..., half:]  # [T, K, F] each
    else:
        gate, up = matrix("gate", x), matrix("up", x)  # [T, K, F]
    h = ACTIVATIONS[activation](gate, up).contiguous()  # [T, K, F]
    y = matrix("down", h)  # [T, K, D]
    if "scale" in layout.biases:
        y = y * bias("scale", ids)  # [T, K, 1]
    return (y * weights[..., None].to(y.dtype)).sum(dim=1)  # [T, D]


class QuantResidentExperts:
    """Every routed expert computed from the mapped file through whole-stack ``mul_mat_id``."""

    def __init__(self, gguf: GGUFFile, kernels: CpuKernels, layers: list[int], activation: str):
        self.activation = activation
        self.layouts = {i: ExpertLayout.from_file(gguf, i) for i in layers}
        self._stacks: dict[tuple[int, str], QuantExperts] = {}
        self._biases: dict[tuple[int, str], torch.Tensor] = {}
        for i, layout in self.layouts.items():
            for kind, part in layout.matrices.items():
                self._stacks[i, kind] = kernels.experts(
                    _stack_bytes(gguf, part), part.ggml_type, (*part.ne, part.n_experts), part.name)
            for kind, part in layout.biases.items():
                raw = _stack_bytes(gguf, part)
                self._biases[i, kind] = torch.from_numpy(  # [X, O], small: decoded once
                    np.frombuffer(raw, dtype=np.uint8).copy()).view(
                    _VECTOR_DTYPES[part.ggml_type]).float().view(part.n_experts, -1)

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], expert_ids/weights [N, K] -> [N, D]."""
        return routed_forward(
            self.layouts[layer],
            lambda kind, inputs, ids: self._stacks[layer, kind].matmul(inputs, ids),
            lambda kind, ids: self._biases[layer, kind][ids],
            self.activation, x, expert_ids, weights)


def _stack_bytes(gguf: GGUFFile, part: ExpertPart) -> memoryview:
    return gguf.tensor_bytes(gguf.tensor(part.name))
