"""Q8_0 expert products: a ggml custom op that gives ``ggml_mul_mat_id``'s bits faster, for
one token or several at once (csrc/q8_0_experts.c says how); and dense Q8_0 products of a few
tokens (``matrix_product``), as one expert every token picks.

ggml's ``mul_mat_id`` runs Q8_0 through ``vec_dot``: one weight row against one token on one
accumulator chain, so two tokens on an expert cost twice one, and a batched step or a prompt
piece runs at the speed of its products rather than of its reads (docs/KERNELS.md, "Q8_0
experts for several tokens"). The custom op computes the same sums, block for block and lane
for lane, one row against up to 4 of an expert's tokens at once, a thread's reads one
sequential stream (faster than ``vec_dot`` even for one token). It is compiled here, for this
CPU, on first use (``cc -O3 -march=native``, kept under ~/.cache/moeswap/kernels by the
source's, compiler's and CPU's hash), and used only once it matched ``mul_mat_id`` bit for bit
on this machine (``_matches``); without a C compiler, on another architecture, with an
unwritable cache, or on any mismatch the graphs keep ``mul_mat_id``.

A node's arguments (the addresses of the weights, the quantized activations and the ids, fixed
for a kept graph) live in a ``ctypes`` struct owned here, one per distinct node, so a graph
built again reuses its struct; the output's address the op reads from its own tensor.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

SOURCE = Path(__file__).with_name("csrc") / "q8_0_experts.c"
MAX_PICKS = 4096  # tokens x picks of one node (the C side's sort buffers)
# Tokens up to which a dense Q8_0 product takes the op; ggml's mul_mat (llamafile's tiles)
# wins beyond. Measured on a 640 x 262,144 head: 1.6-2.0x at 1-4 tokens, 1.1x at 8, 0.9x at 16.
DENSE_TOKENS = 8
PRODUCT_NODES = 4  # tensors ``matrix_product`` makes at most (mul_mat: 1)
_Q8_0, _F32, _I32 = (int(GGMLQuantizationType[n]) for n in ("Q8_0", "F32", "I32"))
_BLOCK, _BLOCK_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]  # 32 numbers, 34 bytes
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Args(ctypes.Structure):
    _fields_ = [("w", _P), ("w_expert_stride", _I64), ("w_row_stride", _I64),
                ("n_rows", _I64), ("n_blocks", _I64),
                ("x", _P), ("x_pick_stride", _I64), ("x_token_stride", _I64), ("x_ne11", _I64),
                ("ids", _P), ("n_picked", _I64), ("n_tokens", _I64)]


@dataclass(frozen=True)
class Q8_0Stack:
    """A plain-layout Q8_0 expert stack (or slot pool): expert e's row r at
    ``address + e * expert_stride + r * row_stride``; ``tensor`` its ggml tensor, ne (in, out,
    X), which the node takes as an argument so the graph orders it."""

    tensor: int
    address: int
    row_stride: int
    expert_stride: int
    in_features: int
    out_features: int

    @classmethod
    def plain(cls, tensor: int, address: int, ne: tuple[int, int],
              expert_stride: int | None = None) -> Q8_0Stack:
        """The stack of ne (in, out) experts at ``address``, one after the other unless
        ``expert_stride`` (a slot pool's slot size) says otherwise."""
        row = row_bytes(ne[0])
        return cls(tensor, address, row, row * ne[1] if expert_stride is None else expert_stride,
                   *ne)


def row_bytes(n: int) -> int:
    """Bytes of a Q8_0 row of n numbers."""
    return n // _BLOCK * _BLOCK_BYTES


class CustomQ8_0:
    """The compiled op and the argument structs of the nodes built on it."""

    def __init__(self, ggml, function: int):
        self.ggml, self.function = ggml, function
        self._args: dict[tuple, _Args] = {}

    @staticmethod
    def takes(n_tokens: int, n_picked: int) -> bool:
        return n_tokens * n_picked <= MAX_PICKS

    def product(self, context: int, arena, stack: Q8_0Stack, b: int, ids: int | None,
                n_tokens: int, n_picked: int) -> int:
        """The node computing ``ggml_mul_mat_id(stack, b, ids)``: b (in, ne11, T) F32
        contiguous, ids (K, T) I32 contiguous -> (out, K, T) F32, placed in ``arena``; ids None:
        every pick is expert 0 (a dense matrix, K = 1)."""
        ggml, t, k = self.ggml, n_tokens, n_picked
        ne11 = ggml.ggml_nelements(b) // (stack.in_features * t)
        quantized = arena.new(_Q8_0, stack.in_features, ne11, t)  # (in, ne11, T)
        quantized = arena.view(ggml.ggml_cpy(context, b, quantized))  # ggml's quantization
        key = (stack, ggml.ggml_get_data(quantized), ids and ggml.ggml_get_data(ids), ne11, t, k)
        args = self._args.get(key)
        if args is None:
            row = row_bytes(stack.in_features)  # of the quantized activations
            args = self._args[key] = _Args(
                stack.address, stack.expert_stride, stack.row_stride, stack.out_features,
                stack.in_features // _BLOCK, key[1], row, row * ne11, ne11, key[2], k, t)
        sources = [stack.tensor, quantized] + ([] if ids is None else [ids])
        return arena.op(ggml.ggml_custom_4d(context, _F32, stack.out_features, k, t, 1,
                                            (_P * len(sources))(*sources), len(sources),
                                            self.function, -1, ctypes.addressof(args)))


def matrix_product(kernels, context: int, arena, weight, x: int) -> int:
    """``ggml_mul_mat(weight.tensor, x)`` for a bound weight (moeswap.quant.kernels, ne (in,
    out), or (in, out, H) heads) and x (in, T) F32 -> (out, T), placed in ``arena``. A
    plain-layout Q8_0 matrix's product of at most DENSE_TOKENS tokens takes the op, as one
    expert every token picks: the same bits (mul_mat's vec_dot sums), read as one sequential
    stream a thread."""
    ggml = kernels.ggml
    n_in, n_out = weight.ne[:2]
    t = ggml.ggml_nelements(x) // n_in
    op = (custom_q8_0(kernels) if weight.ggml_type == _Q8_0 and len(weight.ne) == 2
          and weight.keep_alive is not None and t <= DENSE_TOKENS else None)
    if op is None:  # another type, a repacked copy, more tokens, MLA's stack of heads
        return arena.op(ggml.ggml_mul_mat(context, weight.tensor, x))
    stack = Q8_0Stack.plain(weight.tensor, weight.keep_alive.ctypes.data, weight.ne)
    y = op.product(context, arena, stack, x, None, t, 1)  # (out, 1, T)
    out = arena.view(ggml.ggml_reshape_2d(context, y, n_out, t))
    arena.offsets[out] = arena.offsets[y]  # the same bytes: a graph may read it out
    return out


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # kernels -> op or None


def custom_q8_0(kernels) -> CustomQ8_0 | None:
    """The op for ``kernels``' ggml where it compiles here and matches ``mul_mat_id`` (checked
    once per ``CpuKernels``)."""
    if kernels not in _CHECKED:
        function = _compiled()
        op = None if function is None else CustomQ8_0(kernels.ggml, function)
        _CHECKED[kernels] = op if op is not None and _matches(kernels, op) else None
    return _CHECKED[kernels]


@functools.cache
def _compiled() -> int | None:
    """The op's address, compiled for this CPU once (the library cached on disk)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    flags = ["-O3", "-march=native", "-shared", "-fPIC"]
    # built for this CPU: a home folder shared with another CPU must not load it (SIGILL)
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(
        [compiler, *flags, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MOESWAP_CACHE", "~/.cache/moeswap")).expanduser() / "kernels"
    library = cache / f"q8_0_experts-{digest}.so"
    if not library.exists():
        try:  # an unwritable cache or a vanished compiler: ggml's own product, as without one
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as work:  # renamed whole: no torn file
                built = Path(work) / library.name
                done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)],
                                      capture_output=True)
                if done.returncode != 0:
                    return None
                built.replace(library)
        except OSError:
            return None
    try:
        return ctypes.cast(ctypes.CDLL(str(library)).moeswap_q8_0_experts, _P).value
    except (OSError, AttributeError):
        return None


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux's /proc/cpuinfo), else the processor's name."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _matches(kernels, op: CustomQ8_0) -> bool:
    """Whether the op gives ``mul_mat_id``'s bits on a random stack, tokens sharing experts,
    activations one row a token and one a pick."""
    from moeswap.quant.graph_arena import Arena, new_context

    ggml, rng = kernels.ggml, np.random.default_rng(0)
    d, out, n_experts, t, k = 256, 70, 4, 5, 3
    raw = np.ascontiguousarray(quantize(
        rng.standard_normal((n_experts * out, d), dtype=np.float32), GGMLQuantizationType.Q8_0))
    weight = kernels.bind(raw.reshape(-1), _Q8_0, (d, out, n_experts), "self-check")
    stack = Q8_0Stack.plain(weight.tensor, weight.keep_alive.ctypes.data, (d, out))
    ids = torch.tensor(rng.integers(0, n_experts, (t, k)), dtype=torch.int32)  # [T, K]
    for ne11 in (1, k):
        x = torch.tensor(rng.standard_normal((t, ne11, d)), dtype=torch.float32)
        results = []
        for custom in (False, True):
            context = new_context(ggml, 16)
            try:
                arena = Arena(kernels, context)
                x_in, ids_in = arena.new(_F32, d, ne11, t), arena.new(_I32, k, t)
                y = (op.product(context, arena, stack, x_in, ids_in, t, k) if custom else
                     arena.op(ggml.ggml_mul_mat_id(context, weight.tensor, x_in, ids_in)))
                graph = ggml.ggml_new_graph_custom(context, 16, False)
                ggml.ggml_build_forward_expand(graph, y)
                result = torch.empty(t, k, out)
                kernels.run(graph, [(arena.offsets[x_in], x.data_ptr(), x.nbytes),
                                    (arena.offsets[ids_in], ids.data_ptr(), ids.nbytes)],
                            (result.data_ptr(), result.nbytes), arena.offsets[y])
                results.append(result)
            finally:
                ggml.ggml_free(context)
        if not torch.equal(*results):
            return False
    return True
