"""Routed experts computed by ggml from their stored bytes, and the math every such runner shares.

A layer's routed experts are stored as stacks (GGUF ne ``(in, out, E)``): gate and up, or one
fused gate_up (gate rows first), then down, plus per-expert bias vectors in some families
(GPT-OSS) and a per-expert output scale (Gemma 4, ffn_down_exps.scale). ``ExpertLayout``
describes where one expert's pieces lie in the file; the unit an offload store moves is all of
them together.

The resident runner here runs each step as one fused ggml graph (moeswap.quant.moe_graph) over
the whole stacks in the mapped file; the offload store runs the same graph over the stacks of
its slot pools, on the picks whose experts lie in each pool, and sums the picks' rows as the
graph does (``combine``). Both give bit-identical logits: ggml's ``mul_mat_id`` multiplies each
expert's tokens as one group whatever stack holds the expert (docs/KERNELS.md, "Exactness
across tiers"); the activation is ggml's in both, row by row; adds and multiplies are single
IEEE operations; and both compute on the same pieces of at most ``MAX_TOKENS_PER_CALL``
tokens (``run_in_pieces``; the store cuts each expert's picks of a whole step so,
``picks_by_piece``). ``per_matrix_step`` is the per-matrix path the graph replaced
(three products, torch between them), kept as the reference the graph is tested against and
for the torch device tier.

Legend: N tokens, T tokens of one piece, K experts picked per token, D model width,
F expert width, O a part's output width, X experts in the layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeswap.errors import MoeswapError
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_in_ram import release
from moeswap.models.experts import ACTIVATIONS, OAI_ALPHA, OAI_LIMIT
from moeswap.quant import MAX_TOKENS_PER_CALL, CpuKernels, QuantExperts
from moeswap.quant.moe_graph import Glu, MoeFfn, weight_stacks

VECTOR_DTYPES = {0: torch.float32, 1: torch.float16}  # ggml type id -> torch dtype (biases)

# Each family's expert activation (ModelConfig.expert_act) as the fused graph computes it.
GLUS = {"silu": Glu("silu"), "gelu": Glu("gelu"),
        "swiglu_oai": Glu("swiglu_oai", OAI_ALPHA, OAI_LIMIT)}


@dataclass(frozen=True)
class ExpertPart:
    """One piece of every expert of a layer: a matrix stack (ne in, out, X) or a vector stack."""

    name: str  # the stacked tensor's name
    ggml_type: int
    ne: tuple[int, ...]  # one expert's shape: (in, out) for a matrix, (out,) for a bias
    n_experts: int
    data_start: int  # absolute offset of expert 0 in the file holding the stack
    expert_bytes: int  # one expert's piece; expert e starts at data_start + e * expert_bytes
    file: int = 0  # which piece of a split set holds the stack (0: the only file)

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

    @functools.cached_property
    def down_half(self) -> list[ExpertPart]:
        """The pieces the second half of an expert's graph reads (moeswap.quant.moe_graph,
        ``MoeFfn.finish``): the down matrix, its bias and the output scale."""
        return [self.matrices["down"],
                *(self.biases[kind] for kind in ("down", "scale") if kind in self.biases)]

    @functools.cached_property
    def front(self) -> list[ExpertPart]:
        """The pieces the first half reads (``MoeFfn.hidden``): gate and up, their biases."""
        return [p for p in self.parts if all(p is not d for d in self.down_half)]

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
                              info.data_start, info.n_bytes // n_experts, info.piece)

        p = f"blk.{layer}.ffn_"
        fused = gguf.tensor(p + "gate_up_exps.weight") is not None
        kinds = ("gate_up", "down") if fused else ("gate", "up", "down")
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
            if b.ggml_type not in VECTOR_DTYPES:
                raise MoeswapError(f"{gguf.path}: '{b.name}' must be F32 or F16 to be used "
                                   "as a bias or scale")
        return cls(layer, matrices, biases)


_FEW_PICKS = 16  # up to this many picks a step, grouped without torch ops


@functools.lru_cache(maxsize=1024)
def _few_picks(picks: tuple[int, ...]) -> torch.Tensor:
    """The same tensor for the same few picks (each step's own would cost ~20 us to make);
    shared, so never written to."""
    return torch.tensor(picks)


def group_picks(ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """ids [T, K] -> per used expert, ascending: (expert, its picks as indices into T*K)."""
    flat = ids.flatten()  # [T*K]
    if flat.numel() <= _FEW_PICKS:  # a decode step: plain Python beats torch's per-call cost
        picks_of: dict[int, list[int]] = {}
        for pick, expert in enumerate(flat.tolist()):
            picks_of.setdefault(expert, []).append(pick)
        return [(expert, _few_picks(tuple(picks_of[expert]))) for expert in sorted(picks_of)]
    order = torch.argsort(flat, stable=True)  # [T*K] grouped by expert, tokens ascending
    used, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return list(zip(used.tolist(), order.split(counts.tolist())))


def hidden(activation: str, first: torch.Tensor, up: torch.Tensor | None,
           vectors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Hidden rows [P, F] of P picks from their gate_up rows [P, 2F] (``up`` None) or gate and up
    rows [P, F] each; ``vectors``: the picks' bias rows by part ([P, O])."""
    if up is None:  # fused: gate rows first
        if "gate_up" in vectors:
            first = first + vectors["gate_up"]
        half = first.shape[-1] // 2
        gate, up = first[:, :half], first[:, half:]  # [P, F] each
    else:
        gate = first + vectors["gate"] if "gate" in vectors else first
        up = up + vectors["up"] if "up" in vectors else up
    return ACTIVATIONS[activation](gate, up)  # [P, F]


def output(down: torch.Tensor, vectors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Output rows [P, D] from the picks' down-projection rows: plus their down bias, times
    their output scale ([P, 1]), where the family has them."""
    if "down" in vectors:
        down = down + vectors["down"]
    return down * vectors["scale"] if "scale" in vectors else down


def combine(y: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, K, D] per pick, times weights [T, K] (None: already weighted) -> [T, D], summed
    in pick order as the fused graph sums (one add per pick, so the bits agree)."""
    if weights is not None:
        y = y * weights[..., None].to(y.dtype)
    out = y[:, 0]
    for k in range(1, y.shape[1]):
        out = out + y[:, k]
    return out


def per_matrix_step(product, vectors: dict[str, torch.Tensor], activation: str, fused: bool,
                    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The per-matrix path: x [T, D], ids/weights [T, K] -> [T, D], three products
    ``product(kind, rows [T, S, I] or [T, I], ids) -> [T, K, O]`` and torch between them;
    ``vectors``: the picks' bias / scale rows by kind ([T*K, O])."""
    n_picks = ids.numel()
    if fused:
        h = hidden(activation, product("gate_up", x, ids).view(n_picks, -1), None, vectors)
    else:
        h = hidden(activation, product("gate", x, ids).view(n_picks, -1),
                   product("up", x, ids).view(n_picks, -1), vectors)  # [T*K, F]
    y = product("down", h.view(*ids.shape, -1), ids)  # [T, K, D]
    return combine(output(y.reshape(n_picks, -1), vectors).view(*ids.shape, -1), weights)


def run_in_pieces(piece, x: torch.Tensor, expert_ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """x [N, D], expert_ids/weights [N, K] -> [N, D], computed by ``piece`` on pieces of at most
    MAX_TOKENS_PER_CALL tokens: every runner cuts a batch so, because ggml's result for a token
    may depend on the other tokens of its call."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], MAX_TOKENS_PER_CALL):
        end = min(start + MAX_TOKENS_PER_CALL, x.shape[0])
        out[start:end] = piece(x[start:end], expert_ids[start:end], weights[start:end])
    return out


def picks_by_piece(picks: torch.Tensor, n_picked: int) -> list[torch.Tensor]:
    """picks [P] ascending (indices into N*K, K = ``n_picked``) -> those of each piece
    ``run_in_pieces`` cuts, in order: the offload store reads an expert once for a whole step
    and computes its picks on these pieces, the resident runner's token groups."""
    if picks.numel() and int(picks[-1]) < n_picked * MAX_TOKENS_PER_CALL:
        return [picks]  # all in the first piece (every decode step)
    piece = picks // (n_picked * MAX_TOKENS_PER_CALL)  # [P]
    counts = torch.unique_consecutive(piece, return_counts=True)[1]
    return list(picks.split(counts.tolist()))


class QuantResidentExperts:
    """Every routed expert computed from the mapped file, a step as one fused ggml graph over the
    whole stacks."""

    def __init__(self, gguf: GGUFFile, kernels: CpuKernels, layers: list[int], activation: str):
        self.kernels, self.activation = kernels, activation
        self.layouts = {i: ExpertLayout.from_file(gguf, i) for i in layers}
        self._stacks: dict[tuple[int, str], QuantExperts] = {}
        self._vectors: dict[int, dict[str, torch.Tensor]] = {}  # layer -> part -> [X, O]
        for i, layout in self.layouts.items():
            for kind, part in layout.matrices.items():
                # repacked (a copy) where the kernels repack: the products then leave the
                # store's plain ones in the last bits, as --exact-tiers allows
                stack = self._stacks[i, kind] = kernels.experts(
                    _stack_bytes(gguf, part), part.ggml_type, (*part.ne, part.n_experts), part.name,
                    repack=kernels.repack)
                if stack.weight.keep_alive is None:  # repacked: the stored bytes go unread
                    release(gguf, gguf.tensor(part.name))
            self._vectors[i] = {}
            for kind, part in layout.biases.items():
                raw = _stack_bytes(gguf, part)
                self._vectors[i][kind] = torch.from_numpy(  # [X, O], small: decoded once
                    np.frombuffer(raw, dtype=np.uint8).copy()).view(
                    VECTOR_DTYPES[part.ggml_type]).float().view(part.n_experts, -1)
        self._fuse(layers)

    def _fuse(self, layers: list[int]) -> None:
        """One fused feed-forward per layer over the bound stacks and the decoded vectors."""
        self._ffn: dict[int, MoeFfn] = {}
        for i in layers:
            matrices = {kind: stack.weight for (layer, kind), stack in self._stacks.items()
                        if layer == i}
            vectors = {kind: self.kernels.bind(v.contiguous().numpy(), 0, tuple(v.shape[::-1]),
                                               f"blk.{i}.{kind} vector")  # ne (O, X), F32
                       for kind, v in self._vectors[i].items()}
            self._ffn[i] = MoeFfn(self.kernels, weight_stacks(matrices, vectors),
                                  GLUS[self.activation])

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], expert_ids/weights [N, K] -> [N, D]."""
        return run_in_pieces(self._ffn[layer].run, x, expert_ids, weights)

    def fused(self, layer: int) -> MoeFfn:
        """The layer's fused feed-forward, for a layer graph to build into its own."""
        return self._ffn[layer]

    def per_matrix(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
        """``run`` by the per-matrix path (``per_matrix_step``): the fused graph's reference."""
        def piece(x, ids, weights):
            vectors = {kind: v[ids.flatten()] for kind, v in self._vectors[layer].items()}
            return per_matrix_step(lambda kind, rows, ids: self._stacks[layer, kind].matmul(
                rows, ids), vectors, self.activation, (layer, "gate_up") in self._stacks,
                x, ids, weights)
        return run_in_pieces(piece, x, expert_ids, weights)


class FolderMxfp4Experts(QuantResidentExperts):
    """A HF folder's MXFP4 experts (GPT-OSS as published: ``*_blocks`` / ``*_scales``), computed
    as a GGUF's MXFP4 stacks are: repacked once into ggml's MXFP4 bytes (as llama.cpp's converter
    does, never decoded) and multiplied by ggml; the per-expert biases are read as floats."""

    def __init__(self, weights: Any, kernels: CpuKernels, layers: list[int], activation: str):
        self.kernels, self.activation = kernels, activation
        self._stacks, self._vectors = {}, {}
        for i in layers:
            for kind in ("gate", "up", "down"):
                name = f"blk.{i}.ffn_{kind}_exps.weight"
                packed = weights.mxfp4_bytes(name).numpy()  # [X, O, I/32*17] uint8, kept by the stack
                n_experts, out_features = packed.shape[:2]
                in_features = weights.tensor_shape(name)[-1]
                self._stacks[i, kind] = kernels.experts(
                    packed, GGMLQuantizationType.MXFP4, (in_features, out_features, n_experts), name)
            self._vectors[i] = {kind: weights.tensor(bias).float() for kind in ("gate", "up", "down")
                                if weights.has(bias := f"blk.{i}.ffn_{kind}_exps.bias")}
        self._fuse(layers)


def _stack_bytes(gguf: GGUFFile, part: ExpertPart) -> memoryview:
    return gguf.tensor_bytes(gguf.tensor(part.name))
