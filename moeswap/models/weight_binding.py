"""The weights the families build from: float tensors, plus linear layers and embeddings bound
to whatever computes them best.

``linear(name)`` is a ``QuantLinear`` over ggml kernels for every GGUF matrix not stored as F32
(the stored bytes are computed on directly; no float32 copy is made) and a ``TorchLinear``
otherwise (HF folders; F32 GGUF tensors, which are zero-copy views of the mapped file).
``tensor(name)`` stays for the small float tensors (norms, routers, biases).

With ``anonymous`` (a model whose routed experts the offload store holds) every shared weight
is copied out of the mapped file into anonymous memory as it is bound: the store charges them
to ``--host-mem`` already, and there the page cache cannot evict them under memory pressure
(a cgroup reclaiming a mapped page makes the next token read it again), nor can a model file
truncated under a running process fault inside shared-weight compute.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeswap.errors import MoeswapError
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_in_ram import release
from moeswap.models.linear import (QuantEmbedding, QuantHeads, QuantLinear, TorchEmbedding,
                                   TorchHeads, TorchLinear)
from moeswap.quant import CpuKernels
from moeswap.quant.kernels import _aligned_copy

TOKEN_TABLE = "token_embd.weight"  # the embedding, also the head where they are tied


class BoundWeights:
    def __init__(self, weights: Any, gguf: GGUFFile | None = None,
                 kernels: CpuKernels | None = None, log: Callable[[str], None] | None = None,
                 anonymous: bool = False):
        self.weights = weights  # the float-tensor source (GGUFWeights or SafetensorsWeights)
        self.gguf = gguf  # set for .gguf files: their quantized tensors go to the kernels
        self.kernels = kernels
        self.log = log
        self.anonymous = anonymous  # copy mapped weights into anonymous memory
        self._copies: dict[str, np.ndarray] = {}  # tensor name -> its bytes' copy
        self._released: set[str] = set()  # repacked matrices whose stored bytes went back
        self._floats: dict[str, torch.Tensor] = {}  # a tied table serves embedding and output once

    def _float(self, name: str) -> torch.Tensor:
        if name not in self._floats:
            self._floats[name] = self.tensor(name)
        return self._floats[name]

    def has(self, name: str) -> bool:
        return self.weights.has(name)

    def tensor(self, name: str) -> torch.Tensor:
        self._report(name)
        t = self.weights.tensor(name)
        return t.clone() if self.anonymous and self.weights.describe(name).zero_copy else t

    def _stored_bytes(self, info):
        """A quantized tensor's bytes: the mapped file's, or a copy (``anonymous``; a table
        tied as embedding and output head is copied once)."""
        if info.name in self._released:  # its RAM copy's pages were given back: zeros now
            raise RuntimeError(f"{info.name}: bound twice after its repacked copy replaced it")
        raw = self.gguf.tensor_bytes(info)
        if not self.anonymous:
            return raw
        if info.name not in self._copies:
            self._copies[info.name] = _aligned_copy(np.frombuffer(raw, dtype=np.uint8))
        return self._copies[info.name]

    def vector(self, name: str, length: int) -> torch.Tensor:
        """The tensor ``name`` as a vector [length]. Leading sizes of 1 are dropped, as llama.cpp's
        loader accepts a {n} tensor stored [1, n] (Qwen2-MoE's ffn_gate_inp_shexp); any other
        shape is refused here, at load, naming the tensor."""
        shape = list(self.weights.describe(name).shape)
        if [n for n in shape if n != 1] != [length] or shape[-1] != length:
            raise MoeswapError(f"tensor '{name}' has shape {shape}, expected [{length}]")
        return self.tensor(name).reshape(length)

    def describe(self, name: str):
        return self.weights.describe(name)

    def expert(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        return self.weights.expert(layer, expert, kind)

    def experts(self, layer: int, kind: str) -> torch.Tensor:
        """A float expert stack (the resident runner of F32 files and HF folders)."""
        name = f"blk.{layer}.ffn_{kind}_exps.weight"
        if self.weights.has(name):
            self._report(name)
        else:
            self._report(f"blk.{layer}.ffn_gate_up_exps.weight", note=f" ({kind} half)")
        return self.weights.experts(layer, kind)

    def linear(self, name: str, bias: str | None = None) -> TorchLinear | QuantLinear:
        """The matrix ``name`` ([out, in]) and, when the file has it, the bias ``bias``."""
        b = self.tensor(bias) if bias is not None and self.weights.has(bias) else None
        info = self._stored_quantized(name)
        if info is None:
            return TorchLinear(self._float(name), b)
        self._report(name, quantized=True)
        matrix = self.kernels.matrix(self._stored_bytes(info), info.type_id, tuple(info.shape),
                                     name)
        if matrix.repacked:  # ggml's repacked copy is what is computed on: drop ours
            self._copies.pop(name, None)
            if name != TOKEN_TABLE and release(self.gguf, info):  # a tied table: looked up
                self._released.add(name)
        return QuantLinear(matrix, b)

    def heads(self, name: str) -> TorchHeads | QuantHeads:
        """A stack of one matrix per head ``name`` ([H, out, in]: MLA's attn_k_b, attn_v_b)."""
        info = self._stored_quantized(name)
        if info is None:
            return TorchHeads(self._float(name))
        self._report(name, quantized=True)
        return QuantHeads(self.kernels.experts(self._stored_bytes(info), info.type_id,
                                               tuple(info.shape), name))

    def embedding(self, name: str) -> TorchEmbedding | QuantEmbedding:
        info = self._stored_quantized(name)
        if info is None:
            return TorchEmbedding(self._float(name))
        self._report(name, quantized=True)
        return QuantEmbedding(self._stored_bytes(info), info.type_id, tuple(info.shape))

    def _stored_quantized(self, name: str):
        """The GGUF tensor info when ``name`` is a matrix to compute from its stored bytes."""
        if self.gguf is None:
            return None
        self.weights.describe(name)  # raises the source's error for a missing or broken tensor
        info = self.gguf.tensor(name)
        return None if info.type_id == GGMLQuantizationType.F32 else info

    def _report(self, name: str, *, quantized: bool = False, note: str = "") -> None:
        """One line of the tensor log: name, shape, type, where it lives, where it comes from."""
        if self.log is None:
            return
        d = self.weights.describe(name)
        mapped = "RAM (copied from the file)" if self.anonymous else "mapped file"
        if quantized:
            where = f"{mapped} (computed by kernels)"
        else:
            where = f"{mapped} (zero-copy)" if d.zero_copy and not self.anonymous \
                else "RAM (float32)"
        shape = "x".join(str(n) for n in d.shape)
        self.log(f"{name}{note}  {shape}  {d.type_name}  {where}  from {d.location}")
