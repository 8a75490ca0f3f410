"""One ggml graph per MoE feed-forward step, built once per shape and kept.

For a piece of T tokens with K picked experts each (ids into a stack of X experts), the graph
computes, in the order the per-matrix path does (``QuantExperts`` products with torch between
them, ``moeswap.models.quant_experts.per_matrix_step``): gate and up, or one fused gate_up,
through ``mul_mat_id``, plus their biases; the gated activation; down through ``mul_mat_id``,
plus its bias, times the expert's output scale, times the routing weight; then the sum over the
picks, k = 0, 1, ..., K-1, one ``ggml_add`` each. A call is one copy in of x, ids and weights,
one ``ggml_backend_graph_compute`` and one copy out, where the per-matrix path made three
products and a dozen torch calls.

Exactness: the products are the same ggml kernels on the same token groups (for plain Q8_0
stacks, a custom op with ``mul_mat_id``'s bits: moeswap.quant.q8_0_kernel), and an add or a
multiply is one IEEE operation wherever it runs, so the one difference from the per-matrix path
is the activation: ggml's (silu as ``ggml_swiglu_split``; tanh gelu written out in ggml's exact ops,
since ``ggml_geglu`` reads an fp16 table on the CPU; GPT-OSS's clamped ``ggml_swiglu_oai``)
instead of torch's. Every runner that must agree bit for bit runs this graph.

A stack is a whole tensor (a mapped file's ``[in, out, X]``) or a strided view of a slot pool
whose expert i is slot i (``pool_stacks``), so the expert store computes all the experts of a
step that lie in one pool with one graph.

Legend: T tokens (or picks, K = 1), K picks per token, D model width, F expert width, O a
part's output width, X experts in a stack (or slots in a pool).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moeswap.errors import MoeswapError
from moeswap.quant.ggml_lib import GGML, InitParams
from moeswap.quant.graph_arena import Arena, free_contexts
from moeswap.quant.kernels import CpuKernels, check_status
from moeswap.quant.q8_0_kernel import Q8_0Stack, custom_q8_0

_F32, _I32 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.I32)
_Q8_0 = int(GGMLQuantizationType.Q8_0)
_SQRT_2_PI = math.sqrt(2 / math.pi)


@dataclass(frozen=True)
class Glu:
    """A gated activation: ``silu`` or ``gelu`` (tanh) times up, or GPT-OSS's ``swiglu_oai``
    (gate clamped above at ``limit``, up clamped both ways, gate * sigmoid(alpha gate) * (up + 1))."""

    name: str
    alpha: float = 0.0
    limit: float = 0.0


@dataclass
class ExpertStacks:
    """A layer's expert pieces as ggml tensors, expert (or slot) index last: ``matrices`` by kind
    (``gate_up`` or ``gate`` and ``up``; ``down``) of ne (in, out, X), ``vectors`` by kind (a
    matrix's bias, ne (out, X); ``scale``, ne (1, X)), F32 or F16."""

    matrices: dict[str, int]
    vectors: dict[str, int]
    out_features: dict[str, int]  # kind -> out
    in_features: int  # the model width D
    hidden_width: int  # F, the down matrices' input width
    n_experts: int  # X
    keep_alive: list = field(default_factory=list)  # the weights / pools the tensors point into
    q8_0: dict[str, Q8_0Stack] = field(default_factory=dict)  # kind -> where a plain Q8_0 lies


def weight_stacks(matrices: dict, vectors: dict) -> ExpertStacks:
    """Stacks of bound weights (``CpuKernels.bind``): matrices ne (in, out, X), vectors
    (out, X) by kind."""
    first = matrices["gate_up"] if "gate_up" in matrices else matrices["gate"]
    out_features = {kind: w.ne[1] for kind, w in matrices.items()}
    out_features.update({kind: w.ne[0] for kind, w in vectors.items()})
    q8_0 = {}
    for kind, w in matrices.items():
        if w.ggml_type == _Q8_0 and w.keep_alive is not None:  # plain layout (not repacked)
            q8_0[kind] = Q8_0Stack.plain(w.tensor, w.keep_alive.ctypes.data, w.ne[:2])
    return ExpertStacks({kind: w.tensor for kind, w in matrices.items()},
                        {kind: w.tensor for kind, w in vectors.items()}, out_features,
                        first.ne[0], matrices["down"].ne[0], matrices["down"].ne[2],
                        [*matrices.values(), *vectors.values()], q8_0)


def pool_stacks(kernels: CpuKernels, buffer: np.ndarray, slot_size: int,
                pieces: list[tuple[str, int, tuple[int, ...], int]]) -> ExpertStacks:
    """Stacks over a slot pool ``buffer`` (uint8, ``slot_size`` bytes a slot) whose slots hold
    an expert's ``pieces`` (kind, ggml type, one expert's GGUF ne: (in, out) for a matrix,
    (out,) for a bias, () for a scale; offset in the slot): a piece's
    stack is a view with slot i at ``buffer + i * slot_size + offset``."""
    ggml, n_slots = kernels.ggml, buffer.nbytes // slot_size
    context = ggml.ggml_init(InitParams(2 * len(pieces) * ggml.ggml_tensor_overhead(), None, True))
    pool = ggml.ggml_backend_cpu_buffer_from_ptr(buffer.ctypes.data, buffer.nbytes)
    matrices, vectors, out_features, in_features, hidden_width = {}, {}, {}, 0, 0
    q8_0 = {}
    for kind, ggml_type, ne, offset in pieces:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        # A flat base from the piece's first byte to the pool's end, whole blocks only; ggml
        # checks a view's contiguous size against it (n_slots pieces, never more).
        n_blocks = (buffer.nbytes - offset) // type_size
        base = ggml.ggml_new_tensor_1d(context, ggml_type, n_blocks * block_size)
        check_status(ggml.ggml_backend_tensor_alloc(pool, base, buffer.ctypes.data + offset),
                     "pool stack")
        if len(ne) == 2:  # a matrix: ne (in, out, slots)
            row_bytes = ne[0] // block_size * type_size
            view = ggml.ggml_view_3d(context, base, ne[0], ne[1], n_slots, row_bytes, slot_size, 0)
            matrices[kind] = view
            if ggml_type == _Q8_0:
                q8_0[kind] = Q8_0Stack.plain(view, buffer.ctypes.data + offset, ne, slot_size)
            if kind == "down":
                hidden_width = ne[0]
            else:
                in_features = ne[0]
            out_features[kind] = ne[1]
        else:  # a vector: ne (out, slots); a scale is one number (ne ())
            out_features[kind] = ne[0] if ne else 1
            view = ggml.ggml_view_2d(context, base, out_features[kind], n_slots, slot_size, 0)
            vectors[kind] = view
        check_status(ggml.ggml_backend_view_init(view), "pool stack view")
    stacks = ExpertStacks(matrices, vectors, out_features, in_features, hidden_width, n_slots,
                          [buffer], q8_0)
    weakref.finalize(stacks, _free_pool, ggml, context, pool)
    return stacks


class MoeFfn:
    """The fused feed-forward of one layer's experts; one graph per (stage, T, K), kept.

    ``run`` is the whole step. ``hidden`` and ``finish`` are its two halves, cut at the
    activation's output (a float32 tensor either way, so the halves give ``run``'s bits): for
    an expert whose down matrix arrives after its gate and up (moeswap.experts.step_reads)."""

    def __init__(self, kernels: CpuKernels, stacks: ExpertStacks, glu: Glu):
        if glu.name not in ("silu", "gelu", "swiglu_oai"):
            raise MoeswapError(f"expert activation '{glu.name}' has no fused graph; "
                               "known: silu, gelu, swiglu_oai")
        self.kernels, self.stacks, self.glu = kernels, stacks, glu
        # Q8_0 products through the faster custom op, same bits
        self.custom = custom_q8_0(kernels) if stacks.q8_0 else None
        self.width = stacks.out_features["down"]
        self.hidden_width = stacks.hidden_width
        self._graphs: dict[tuple[str, int, int], _Graph] = {}
        self._contexts: list[int] = []
        weakref.finalize(self, free_contexts, kernels.ggml, self._contexts)

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], ids [T, K] (indices into the stacks), weights [T, K] -> [T, D]:
        sum over k of weights[t, k] * (expert ids[t, k] applied to x[t])."""
        return self._call("all", self._rows(x, ids.shape[0], self.stacks.in_features), ids,
                          weights, (ids.shape[0], self.width))

    def hidden(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, D], ids [T, K] -> the activation's output [T, K, F]."""
        n_tokens, n_picked = ids.shape
        return self._call("hidden", self._rows(x, n_tokens, self.stacks.in_features), ids, None,
                          (n_tokens, n_picked, self.hidden_width))

    def finish(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, K, F] from ``hidden``, ids and weights [T, K] -> [T, D], as ``run``."""
        rows = self._rows(h.reshape(-1, h.shape[-1]), h.numel() // self.hidden_width,
                          self.hidden_width)
        return self._call("down", rows, ids, weights, (ids.shape[0], self.width))

    def _rows(self, x: torch.Tensor, n_rows: int, width: int) -> torch.Tensor:
        if x.shape != (n_rows, width):
            raise ValueError(f"expected input [{n_rows}, {width}], got {tuple(x.shape)}")
        return x.detach().to("cpu", torch.float32).contiguous()

    def _call(self, stage: str, rows: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor | None, out_shape: tuple[int, ...]) -> torch.Tensor:
        picks = ids.to("cpu", torch.int32).contiguous()  # [T, K]
        # As unsigned, negative ids become huge: one reduction checks both ends (ggml aborts).
        if picks.numel() and int(picks.numpy().view(np.uint32).max()) >= self.stacks.n_experts:
            raise ValueError(f"expert ids must lie in [0, {self.stacks.n_experts}), got "
                             f"{int(picks.min())}..{int(picks.max())}")
        inputs = [rows, picks]
        if weights is not None:
            if weights.shape != ids.shape:
                raise ValueError(f"weights must be {tuple(ids.shape)}, got {tuple(weights.shape)}")
            inputs.append(weights.detach().to("cpu", torch.float32).contiguous())  # [T, K]
        key = (stage, *ids.shape)
        if key not in self._graphs:
            self._graphs[key] = _build(self, stage, *ids.shape)
        graph = self._graphs[key]
        y = torch.empty(out_shape)
        self.kernels.run(graph.graph, [(offset, t.data_ptr(), t.nbytes)
                                       for offset, t in zip(graph.inputs, inputs)],
                         (y.data_ptr(), y.nbytes), graph.output)
        return y

    def nodes(self, context: int, arena: Arena, stage: str, rows: int, ids: int,
              weights: int | None, n_tokens: int, n_picked: int) -> int:
        """The step's nodes in ``context`` for T = n_tokens, K = n_picked, on tensors rows
        (D, 1, T), or (F, K, T) for "down"; ids (K, T) I32, contiguous; weights (1, K, T), None
        for "hidden" -> the result: (D, T), or (F, K, T) for "hidden". A layer graph
        (moeswap.models.ggml_attention) builds them on its own routing."""
        ggml, stacks, t, k = self.kernels.ggml, self.stacks, n_tokens, n_picked
        flat_ids = arena.view(ggml.ggml_view_1d(context, ids, k * t, 0))  # (K*T)

        custom = self.custom if self.custom is not None and self.custom.takes(t, k) else None

        def product(kind: str, b: int) -> int:
            """mul_mat_id with the kind's stack, plus its bias -> (O, K, T)."""
            if custom is not None and kind in stacks.q8_0:
                y = custom.product(context, arena, stacks.q8_0[kind], b, ids, t, k)
            else:
                y = arena.op(ggml.ggml_mul_mat_id(context, stacks.matrices[kind], b, ids))
            return with_vector(y, kind, ggml.ggml_add)

        def with_vector(y: int, kind: str, combine) -> int:
            """y (O, K, T) combined with each pick's row of the vector stack ``kind``, if any."""
            if kind not in stacks.vectors:
                return y
            picked = arena.op(ggml.ggml_get_rows(context, stacks.vectors[kind], flat_ids))
            picked = arena.view(ggml.ggml_reshape_3d(
                context, picked, stacks.out_features[kind], k, t))  # (O, K, T)
            return arena.op(combine(context, y, picked))

        if stage == "down":
            hidden = rows
        else:
            if "gate_up" in stacks.matrices:  # fused: gate rows first
                both = product("gate_up", rows)  # (2F, K, T)
                f = stacks.out_features["gate_up"] // 2
                row, pick = 2 * f * 4, 2 * f * k * 4  # the fused rows' strides in bytes (f32)
                gate = arena.view(ggml.ggml_view_3d(context, both, f, k, t, row, pick, 0))
                up = arena.view(ggml.ggml_view_3d(context, both, f, k, t, row, pick, f * 4))
            else:
                gate, up = product("gate", rows), product("up", rows)  # (F, K, T) each
            glu = self.glu
            if glu.name == "silu":
                hidden = arena.op(ggml.ggml_swiglu_split(context, gate, up))
            elif glu.name == "gelu":
                hidden = arena.op(ggml.ggml_mul(context, gelu_tanh(ggml, context, arena, gate),
                                                up))
            else:
                hidden = arena.op(ggml.ggml_swiglu_oai(context, gate, up, glu.alpha, glu.limit))
            if stage == "hidden":
                return hidden  # (F, K, T)
        y = product("down", hidden)  # (D, K, T)
        y = with_vector(y, "scale", ggml.ggml_mul)  # times the expert's output scale
        out = y = arena.op(ggml.ggml_mul(context, y, weights))  # times the routing weight
        d = self.width
        if k > 1:  # the sum over picks, in pick order
            views = [arena.view(ggml.ggml_view_2d(context, y, d, t, d * k * 4, i * d * 4))
                     for i in range(k)]  # (D, T) each
            out = views[0]
            for other in views[1:]:
                out = arena.op(ggml.ggml_add(context, out, other))  # (D, T)
        return out


@dataclass
class _Graph:
    graph: int
    inputs: tuple[int, ...]  # scratch offsets of the rows, ids (and weights)
    output: int  # scratch offset of the result


def _build(ffn: MoeFfn, stage: str, n_tokens: int, n_picked: int) -> _Graph:
    """The graph of ``stage`` ("all", "hidden" or "down") for T = n_tokens, K = n_picked;
    shapes in ggml order (ne0 first)."""
    ggml, t, k = ffn.kernels.ggml, n_tokens, n_picked
    n_tensors, n_nodes = 40 + 3 * k, 64 + 4 * k
    size = n_tensors * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead_custom(n_nodes, False)
    context = ggml.ggml_init(InitParams(size, None, True))
    ffn._contexts.append(context)
    arena = Arena(ffn.kernels, context)
    if stage == "down":
        rows = arena.new(_F32, ffn.hidden_width, k, t)  # (F, K, T): one row per pick
    else:
        rows = arena.new(_F32, ffn.stacks.in_features, 1, t)  # (D, 1, T): one row for all picks
    ids = arena.new(_I32, k, t)  # (K, T)
    weights = arena.new(_F32, 1, k, t) if stage != "hidden" else None  # (1, K, T)
    out = ffn.nodes(context, arena, stage, rows, ids, weights, t, k)
    graph = ggml.ggml_new_graph_custom(context, n_nodes, False)
    ggml.ggml_build_forward_expand(graph, out)
    inputs = [rows, ids] if weights is None else [rows, ids, weights]
    return _Graph(graph, tuple(arena.offsets[tensor] for tensor in inputs), arena.offsets[out])


def gelu_tanh(ggml: GGML, context: int, arena: Arena, x: int) -> int:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) from ggml's vectorized ops: since
    0.5 (1 + tanh(u)) = sigmoid(2u), it is silu(v) / (2c (1 + a x^2)) with v = 2c x (1 + a x^2),
    c = sqrt(2/pi), a = 0.044715 (the divisor >= 2c, never 0). ggml's own gelu reads an fp16
    table on the CPU (1e-3 off torch's; llama.cpp takes that); its tanh is scalar libm, ~9x the
    time of a prompt piece's FFN products on Gemma 3 (docs/KERNELS.md)."""
    square = arena.op(ggml.ggml_mul(context, x, x))
    widen = arena.op(ggml.ggml_scale_bias(context, square, 0.044715, 1.0))  # 1 + a x^2
    v = arena.op(ggml.ggml_scale(context, arena.op(ggml.ggml_mul(context, x, widen)),
                                 2 * _SQRT_2_PI))
    divisor = arena.op(ggml.ggml_scale(context, widen, 2 * _SQRT_2_PI))
    return arena.op(ggml.ggml_div(context, arena.op(ggml.ggml_silu(context, v)), divisor))


def _free_pool(ggml: GGML, context: int, buffer: int) -> None:
    ggml.ggml_free(context)
    ggml.ggml_backend_buffer_free(buffer)
