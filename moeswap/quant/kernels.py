"""Matrix products computed directly on stored quantized bytes, on the CPU, through ggml.

One ``CpuKernels`` object owns what every product shares: ggml's CPU backend, its thread
pool, and a scratch area that inputs are copied into and outputs read from. Weights are
bound once, without copying, as ``QuantMatrix`` (one ``[out, in]`` matrix: a dense layer or a
single expert) or ``QuantExperts`` (a stack ``[E, out, in]`` multiplied per token by the experts
the router picked). For each token count a one-node ggml graph is built on first use and kept,
so a call costs two copies and one ``ggml_backend_graph_compute``.

ggml quantizes the activations on the fly to the type its dot product wants (Q8_K for the
K-quants, Q8_0 for Q4_0/Q5_0/Q8_0/MXFP4, ...); docs/KERNELS.md gives the accuracy this costs.
Through ``QuantExperts`` an expert's result depends only on its bytes and the tokens computed
with it, not on where the bytes lie or on the thread count: an expert gives the same bits from
any tier (docs/KERNELS.md, "Exactness across tiers").
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moeswap.errors import MoeswapError
from moeswap.quant.ggml_lib import GGML, THREADPOOL_PARAMS_BYTES, InitParams, load_ggml
from moeswap.quant.repack import repacked_matrix

# Weight types whose products are tested against the reference (tests/test_quant_kernels.py).
SUPPORTED_TYPES = frozenset(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
    # The low-bit grids of the files big MoE models are published in (DeepSeek, Kimi, Qwen3
    # 235B "UD" mixes): 1.56 to 3.44 bits a weight, codebook lookups in ggml's dot products.
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "TQ1_0", "TQ2_0"))

# Longer inputs (prefill) are cut into pieces of this many tokens, so each weight keeps at most
# this many prepared graphs.
MAX_TOKENS_PER_CALL = 32

# Scratch regions. Reserved as anonymous virtual memory: only the pages a call touches are ever
# committed. 256 MiB holds 32 tokens x 8 experts x 262144 floats. The work region holds every
# tensor of a fused feed-forward graph (moeswap.quant.moe_graph), one graph at a time.
REGION_BYTES = 256 << 20
_INPUT_OFFSET, _IDS_OFFSET, _OUTPUT_OFFSET = 0, REGION_BYTES, 2 * REGION_BYTES
WORK_OFFSET = 3 * REGION_BYTES
_SCRATCH_BYTES = 4 * REGION_BYTES
_TENSOR_ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT; ggml aborts on less-aligned weight bytes
_F32, _I32 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.I32)


def default_thread_count() -> int:
    """All cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class CpuKernels:
    """The shared CPU runtime: backend, thread pool, scratch. Calls are serialised by a lock."""

    def __init__(self, n_threads: int | None = None, repack: bool = False):
        """repack: dense matrices go into ggml's repacked layouts where it has one (``matrix``)."""
        self.ggml = ggml = load_ggml()
        self.repack = repack
        self.n_threads = n_threads or default_thread_count()
        if self.n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {self.n_threads}")
        self._backend = ggml.ggml_backend_cpu_init()
        ggml.ggml_backend_cpu_set_n_threads(self._backend, self.n_threads)
        # Without a pool of its own, a ggml built without OpenMP starts and joins threads on
        # every call (with OpenMP the pool only carries the thread count).
        params = ctypes.create_string_buffer(THREADPOOL_PARAMS_BYTES)
        ggml.ggml_threadpool_params_init(params, self.n_threads)
        self._threadpool = ggml.ggml_threadpool_new(params)
        ggml.ggml_backend_cpu_set_threadpool(self._backend, self._threadpool)
        self._scratch = mmap.mmap(-1, _SCRATCH_BYTES)
        self._scratch_view = ctypes.c_char.from_buffer(self._scratch)
        self.scratch_address = ctypes.addressof(self._scratch_view)
        self._scratch_buffer = ggml.ggml_backend_cpu_buffer_from_ptr(
            self.scratch_address, _SCRATCH_BYTES)
        self._lock = threading.Lock()
        # The mmap itself is released by the garbage collector once this object is gone.
        weakref.finalize(self, _free_runtime, ggml, self._backend, self._threadpool,
                         self._scratch_buffer)

    def matrix(self, raw, ggml_type: int, ne: tuple[int, int], name: str = "weight",
               repack: bool | None = None) -> QuantMatrix:
        """Bind one matrix of GGUF shape ``ne = (in, out)`` stored in ``raw`` (not copied).

        ``name`` (the tensor's, e.g. ``blk.0.ffn_down.weight``) labels error messages.
        ``repack`` (None: this object's): copy it into ggml's repacked layout for this CPU
        where ggml has one for its type and shape (moeswap.quant.repack; the copy replaces the
        stored bytes, and products differ from the plain layout's in the last bits).
        """
        weight = _bind_weight(self.ggml, raw, ggml_type, tuple(ne), 2, name)
        if self.repack if repack is None else repack:
            weight = _repacked(self.ggml, weight) or weight
        return QuantMatrix(self, weight)

    def experts(self, raw, ggml_type: int, ne: tuple[int, int, int], name: str = "weight",
                repack: bool = False) -> QuantExperts:
        """Bind an expert stack of GGUF shape ``ne = (in, out, E)`` stored in ``raw``;
        ``repack``: copied into ggml's repacked layout where it has one (``mul_mat_id`` over
        the repacked stack; a resident model's, never a store's slots)."""
        weight = _bind_weight(self.ggml, raw, ggml_type, tuple(ne), 3, name)
        if repack:
            weight = _repacked(self.ggml, weight) or weight
        return QuantExperts(self, weight)

    def bind(self, raw, ggml_type: int, ne: tuple[int, ...], name: str = "weight") -> _Weight:
        """A tensor of GGUF shape ``ne`` (2 or 3 dimensions) on ``raw``, not copied: for graphs
        that take weights as operands (moeswap.quant.moe_graph)."""
        return _bind_weight(self.ggml, raw, ggml_type, tuple(ne), len(ne), name)

    def scratch_tensor(self, context: int, ggml_type: int, ne: tuple[int, ...],
                       offset: int) -> int:
        """A new tensor of ``context`` whose data is the scratch region at ``offset``."""
        tensor = self.ggml.ggml_new_tensor_3d(context, ggml_type, *ne, *([1] * (3 - len(ne))))
        self.place_in_scratch(tensor, offset)
        return tensor

    def place_in_scratch(self, tensor: int, offset: int) -> None:
        """Point ``tensor``'s data at the scratch region starting at ``offset``."""
        n_bytes = self.ggml.ggml_nbytes(tensor)
        if n_bytes > REGION_BYTES:  # checked here: ggml would abort the process
            raise MoeswapError(f"a product needing {n_bytes} bytes of scratch exceeds the "
                               f"{REGION_BYTES}-byte region; call with fewer picked experts")
        check_status(self.ggml.ggml_backend_tensor_alloc(
            self._scratch_buffer, tensor, self.scratch_address + offset), "scratch tensor")

    def run(self, graph: int, inputs: list[tuple[int, int, int]], output: tuple[int, int],
            output_offset: int = _OUTPUT_OFFSET, more: Sequence[tuple[int, int, int]] = ()):
        """Copy ``inputs`` (scratch offset, source address, bytes) in, compute, copy
        ``output`` (destination address, bytes) out from ``output_offset``, and ``more``
        outputs (destination address, bytes, scratch offset)."""
        with self._lock:
            for offset, source, n_bytes in inputs:
                ctypes.memmove(self.scratch_address + offset, source, n_bytes)
            check_status(self.ggml.ggml_backend_graph_compute(self._backend, graph), "compute")
            destination, n_bytes = output
            ctypes.memmove(destination, self.scratch_address + output_offset, n_bytes)
            for destination, n_bytes, offset in more:
                ctypes.memmove(destination, self.scratch_address + offset, n_bytes)


@dataclass
class _Weight:
    """A weight tensor living in a ggml context, its data pointing at the caller's bytes."""

    ggml_type: int
    ne: tuple[int, ...]
    tensor: int
    contexts: list[int]  # the weight's own, then one per prepared graph; freed together
    keep_alive: object  # the array whose memory the tensor points into


def _bind_weight(ggml: GGML, raw, ggml_type: int, ne: tuple[int, ...], dims: int,
                 name: str) -> _Weight:
    known = {int(t) for t in GGMLQuantizationType}
    type_name = GGMLQuantizationType(ggml_type).name if ggml_type in known else str(ggml_type)
    if ggml_type not in known or GGMLQuantizationType(ggml_type) not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise MoeswapError(f"{name}: weight type {type_name} has no CPU kernel here; "
                           f"supported: {supported} (requantize the file, e.g. to Q8_0)")
    ggml_type = GGMLQuantizationType(ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if len(ne) != dims or ne[0] % block_size:
        raise MoeswapError(f"{name}: a {type_name} weight of shape {list(ne)} cannot be "
                           f"multiplied: need {dims} dimensions and a first dimension divisible "
                           f"by {block_size}")
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    data = data.reshape(-1).view(np.uint8)
    expected = ne[0] // block_size * type_size * int(np.prod(ne[1:]))
    if data.nbytes != expected:
        raise MoeswapError(f"{name}: a {type_name} weight of shape {list(ne)} takes {expected} "
                           f"bytes, got {data.nbytes}: the tensor's offset or shape is wrong")
    if data.ctypes.data % _TENSOR_ALIGNMENT:
        data = _aligned_copy(data)  # GGUF data is 32-byte aligned; only odd buffers land here
    context = ggml.ggml_init(InitParams(ggml.ggml_tensor_overhead(), None, True))
    new = ggml.ggml_new_tensor_2d if dims == 2 else ggml.ggml_new_tensor_3d
    tensor = new(context, int(ggml_type), *ne)
    buffer = ggml.ggml_backend_cpu_buffer_from_ptr(data.ctypes.data, data.nbytes)
    check_status(ggml.ggml_backend_tensor_alloc(buffer, tensor, data.ctypes.data), "weight")
    weight = _Weight(int(ggml_type), ne, tensor, [context], data)
    weakref.finalize(weight, _free_weight, ggml, weight.contexts, buffer)
    return weight


def _repacked(ggml: GGML, plain: _Weight) -> _Weight | None:
    """The weight copied into ggml's repacked layout, or None where ggml keeps it plain."""
    made = repacked_matrix(ggml, plain.keep_alive, plain.ggml_type, plain.ne)
    if made is None:
        return None
    context, tensor, buffer = made
    weight = _Weight(plain.ggml_type, plain.ne, tensor, [context], None)
    weakref.finalize(weight, _free_weight, ggml, weight.contexts, buffer)
    return weight


class QuantMatrix:
    """``y = x @ W.T`` for one stored matrix W of GGUF shape (in, out)."""

    def __init__(self, kernels: CpuKernels, weight: _Weight):
        self.kernels = kernels
        self.weight = weight
        self.in_features, self.out_features = weight.ne
        self._graphs: dict[int, int] = {}

    @property
    def repacked(self) -> bool:
        """Whether ggml's repacked copy is computed on (the stored bytes are not kept)."""
        return self.weight.keep_alive is None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] float32 (T: tokens)."""
        x = _float_rows(x, self.in_features)
        n_tokens, in_bytes, out_bytes = x.shape[0], self.in_features * 4, self.out_features * 4
        y = torch.empty(n_tokens, self.out_features)  # [T, out]
        x_address, y_address = x.data_ptr(), y.data_ptr()
        # Addresses rather than tensor slices: this loop is the per-call overhead.
        for start in range(0, n_tokens, MAX_TOKENS_PER_CALL):
            count = min(MAX_TOKENS_PER_CALL, n_tokens - start)
            self.kernels.run(self._graph(count),
                             [(_INPUT_OFFSET, x_address + start * in_bytes, count * in_bytes)],
                             (y_address + start * out_bytes, count * out_bytes))
        return y

    def _graph(self, n_tokens: int) -> int:
        if n_tokens not in self._graphs:
            kernels, context = self.kernels, _graph_context(self.kernels.ggml, self.weight)
            x = kernels.scratch_tensor(context, _F32, (self.in_features, n_tokens), _INPUT_OFFSET)
            y = kernels.ggml.ggml_mul_mat(context, self.weight.tensor, x)  # ne (out, t)
            self._graphs[n_tokens] = _one_node_graph(kernels, context, y)
        return self._graphs[n_tokens]


class QuantExperts:
    """Per-token products with the experts a router picked, from a stack of GGUF shape (in, out, E)."""

    def __init__(self, kernels: CpuKernels, weight: _Weight):
        self.kernels = kernels
        self.weight = weight
        self.in_features, self.out_features, self.n_experts = weight.ne
        self._graphs: dict[tuple[int, int, int], int] = {}

    def matmul(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, in] (one row for all picks) or [T, K, in]; ids: [T, K] -> [T, K, out].

        T: tokens, K: experts picked per token; out[t, k] = W[ids[t, k]] @ x[t(, k)].
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must be [tokens, picked], got shape {tuple(ids.shape)}")
        n_tokens, n_picked = ids.shape
        per_token = x.shape[1] if x.dim() == 3 else 1  # S: input rows per token, 1 or K
        if x.dim() not in (2, 3) or x.shape[0] != n_tokens or per_token not in (1, n_picked):
            raise ValueError(f"x must be [{n_tokens}, in] or [{n_tokens}, {n_picked}, in], "
                             f"got {tuple(x.shape)}")
        rows = _float_rows(x.reshape(n_tokens * per_token, x.shape[-1]), self.in_features)
        picks = ids.to("cpu", torch.int32).contiguous()  # [T, K]
        # As unsigned, negative ids become huge: one reduction checks both ends.
        if picks.numel() and int(picks.numpy().view(np.uint32).max()) >= self.n_experts:
            raise ValueError(f"expert ids must lie in [0, {self.n_experts}), got "
                             f"{int(picks.min())}..{int(picks.max())}")
        y = torch.empty(n_tokens, n_picked, self.out_features)  # [T, K, out]
        # Bytes per token of: input rows (S of them), ids (K), outputs (K rows).
        in_bytes, ids_bytes = per_token * self.in_features * 4, n_picked * 4
        out_bytes = n_picked * self.out_features * 4
        x_address, ids_address, y_address = rows.data_ptr(), picks.data_ptr(), y.data_ptr()
        for start in range(0, n_tokens, MAX_TOKENS_PER_CALL):
            count = min(MAX_TOKENS_PER_CALL, n_tokens - start)
            self.kernels.run(
                self._graph(count, n_picked, per_token),
                [(_INPUT_OFFSET, x_address + start * in_bytes, count * in_bytes),
                 (_IDS_OFFSET, ids_address + start * ids_bytes, count * ids_bytes)],
                (y_address + start * out_bytes, count * out_bytes))
        return y

    def _graph(self, n_tokens: int, n_picked: int, per_token: int) -> int:
        key = (n_tokens, n_picked, per_token)
        if key not in self._graphs:
            kernels, context = self.kernels, _graph_context(self.kernels.ggml, self.weight)
            x = kernels.scratch_tensor(
                context, _F32, (self.in_features, per_token, n_tokens), _INPUT_OFFSET)
            ids = kernels.scratch_tensor(context, _I32, (n_picked, n_tokens), _IDS_OFFSET)
            y = kernels.ggml.ggml_mul_mat_id(context, self.weight.tensor, x, ids)  # (out, K, t)
            self._graphs[key] = _one_node_graph(kernels, context, y)
        return self._graphs[key]


def _graph_context(ggml: GGML, weight: _Weight) -> int:
    """A metadata-only context for one graph: up to 4 tensors and a 4-node graph."""
    size = 4 * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead_custom(4, False)
    context = ggml.ggml_init(InitParams(size, None, True))
    weight.contexts.append(context)
    return context


def _one_node_graph(kernels: CpuKernels, context: int, result: int) -> int:
    kernels.place_in_scratch(result, _OUTPUT_OFFSET)
    graph = kernels.ggml.ggml_new_graph_custom(context, 4, False)
    kernels.ggml.ggml_build_forward_expand(graph, result)
    return graph


def _float_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"expected input [tokens, {width}], got {tuple(x.shape)}")
    return x.detach().to("cpu", torch.float32).contiguous()


def _aligned_copy(data: np.ndarray) -> np.ndarray:
    spare = np.empty(data.nbytes + _TENSOR_ALIGNMENT, dtype=np.uint8)
    start = -spare.ctypes.data % _TENSOR_ALIGNMENT
    aligned = spare[start:start + data.nbytes]
    aligned[:] = data
    return aligned


def check_status(status: int, what: str) -> None:
    if status != 0:  # GGML_STATUS_SUCCESS
        raise RuntimeError(f"ggml failed ({what}): status {status}")


def _free_weight(ggml: GGML, contexts: list[int], buffer: int) -> None:
    for context in contexts:
        ggml.ggml_free(context)
    ggml.ggml_backend_buffer_free(buffer)


def _free_runtime(ggml: GGML, backend: int, threadpool: int, buffer: int) -> None:
    ggml.ggml_backend_free(backend)
    ggml.ggml_threadpool_free(threadpool)
    ggml.ggml_backend_buffer_free(buffer)


def needs_importance(ggml_type: int) -> bool:
    """Whether ggml quantizes this type only with an importance matrix (IQ1_S, IQ1_M, IQ2_XXS,
    IQ2_XS: their grids are too coarse to pick points without weighting the columns)."""
    return bool(load_ggml().ggml_quantize_requires_imatrix(int(ggml_type)))


def quantize_rows(values: np.ndarray, ggml_type: int,
                  importance: np.ndarray | None = None) -> np.ndarray:
    """values: [rows, in] float -> the stored bytes [rows, row_bytes] uint8, by ggml's quantizer.

    gguf-py cannot quantize the K-quants or the IQ grids; ggml can quantize every supported
    type. ``importance`` [in]: llama.cpp's importance matrix for this weight (the mean squared
    activation of each input column), which the quantizer weights its error by; required
    where ``needs_importance``.
    """
    ggml, ggml_type = load_ggml(), GGMLQuantizationType(ggml_type)
    values = np.ascontiguousarray(values, dtype=np.float32)
    rows, width = values.shape
    if importance is None and needs_importance(ggml_type):
        raise MoeswapError(f"{ggml_type.name} needs an importance matrix to quantize")
    if importance is not None:
        importance = np.ascontiguousarray(importance, dtype=np.float32)
        if importance.shape != (width,):
            raise MoeswapError(f"the importance matrix has shape {importance.shape}, expected "
                               f"({width},): one number per input column")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if width % block_size:
        raise MoeswapError(f"{ggml_type.name} rows must be a multiple of {block_size} wide")
    out = np.empty((rows, width // block_size * type_size), dtype=np.uint8)
    if ggml_type == GGMLQuantizationType.F32:  # ggml_quantize_chunk does not take F32
        out[:] = values.view(np.uint8)
    else:
        ggml.ggml_quantize_chunk(int(ggml_type), values.ctypes.data, out.ctypes.data, 0, rows,
                                 width, None if importance is None else importance.ctypes.data)
    return out
