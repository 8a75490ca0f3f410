"""Building blocks shared by every family: RMSNorm, RoPE, attention with a KV cache, dense FFN.

Math only: tensors in, tensors out. A forward pass runs a batch of sequences at once: their
tokens are concatenated along one axis (N = sum of the sequences' new tokens) for every
position-wise op, and attention runs per sequence against that sequence's own cache.

Legend used in shape comments: N tokens of the batch, T new tokens of one sequence,
S cached + new positions of one sequence, D model width, H query heads, K kv heads,
G = H / K query heads per kv head, E head size, R rotated dims per head, F FFN width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moeswap.formats.rope_scaling import Yarn


# A linear layer as the model sees it: x [N, in] -> [N, out]. The loader picks the kind
# (moeswap.models.linear): a torch weight, or ggml kernels on the stored quantized bytes.
Linear = Callable[[torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (Gemma's +1 is already in weight)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class KVCache:
    """Keys and values of one sequence, one growing buffer per layer: [S, K, E].

    Each layer's entry shape is that of its first append, so layers may differ (MLA caches
    one latent per token: keys [S, 1, kv_lora + rope] and zero-width values).
    """

    def __init__(self, n_layer: int):
        self.length = 0  # positions already processed
        self._keys: list[torch.Tensor | None] = [None] * n_layer
        self._values: list[torch.Tensor | None] = [None] * n_layer

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' k, v [T, K, E] after `length`; return all [S, K, E] so far."""
        end = self.length + k.shape[0]
        keys = self._keys[layer]
        if keys is None or keys.shape[0] < end:
            capacity = max(end, 2 * (0 if keys is None else keys.shape[0]), 16)
            keys = self._grow(keys, capacity, k)
            self._values[layer] = self._grow(self._values[layer], capacity, v)
            self._keys[layer] = keys
        values = self._values[layer]
        keys[self.length:end] = k
        values[self.length:end] = v
        return keys[:end], values[:end]

    def n_floats(self) -> int:
        """Numbers stored for the committed positions, keys and values of every layer."""
        return sum(t[: self.length].numel() for t in (*self._keys, *self._values) if t is not None)

    def advance(self, n_tokens: int) -> None:
        """Commit the tokens every layer has appended."""
        self.length += n_tokens

    def _grow(self, old: torch.Tensor | None, capacity: int, like: torch.Tensor) -> torch.Tensor:
        new = torch.empty((capacity, *like.shape[1:]), dtype=like.dtype)
        if old is not None:
            new[: self.length] = old[: self.length]
        return new


@dataclass
class Batch:
    """Where each sequence's new tokens sit in the concatenated batch, and their caches."""

    positions: torch.Tensor  # [N] absolute position of every token
    spans: list[tuple[int, int]]  # per sequence: [start, end) into the N axis
    caches: list[KVCache]


class Rope:
    """Rotary position embedding: llama.cpp's NORM (adjacent pairs) or NeoX (halves) layout,
    with linear or YaRN scaling (ggml's rope_yarn: per pair, blend the interpolated and the
    original frequency along a ramp over the correction dims; cos/sin times yarn.mscale)."""

    def __init__(self, n_rot: int, base: float, scale: float, neox: bool,
                 freq_factors: torch.Tensor | None = None, yarn: Yarn | None = None):
        exponents = torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot
        inv_freq = base ** -exponents  # [R/2]
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(torch.float64)
        self.inv_freq = inv_freq / scale
        self.mscale = 1.0
        if yarn is not None:
            low, high = (_yarn_corr_dim(n_rot, yarn.orig_ctx, beta, base)
                         for beta in (yarn.beta_fast, yarn.beta_slow))
            if yarn.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, n_rot - 1)
            pair = torch.arange(n_rot // 2, dtype=torch.float64)  # [R/2]
            extrapolate = 1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)  # 1: keep original
            self.inv_freq = inv_freq / yarn.factor * (1 - extrapolate) + inv_freq * extrapolate
            self.mscale = yarn.mscale
        self.n_rot = n_rot
        self.neox = neox

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, H, E], positions [N] -> x rotated in its first R dims."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]  # [N, R/2]
        cos = (angles.cos() * self.mscale).to(x.dtype)[:, None, :]  # [N, 1, R/2]
        sin = (angles.sin() * self.mscale).to(x.dtype)[:, None, :]
        rot, rest = x[..., : self.n_rot], x[..., self.n_rot:]
        if self.neox:
            a, b = rot[..., : self.n_rot // 2], rot[..., self.n_rot // 2:]
            rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
        return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def _yarn_corr_dim(n_rot: int, orig_ctx: int, n_rotations: float, base: float) -> float:
    """The dim whose wavelength fits `n_rotations` times in the original context."""
    return n_rot * math.log(orig_ctx / (n_rotations * 2 * math.pi)) / (2 * math.log(base))


@dataclass
class AttentionWeights:
    wq: Linear  # x [N, D] -> [N, H*E], with the projection's bias when the family has one
    wk: Linear  # [N, D] -> [N, K*E]
    wv: Linear  # [N, D] -> [N, K*E]
    wo: Linear  # [N, H*E] -> [N, D]
    q_norm: torch.Tensor | None = None  # [E] per head, or [H*E] over the whole projection (OLMoE)
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [H] per-head sink logit joining the softmax (GPT-OSS)


@dataclass
class AttentionSpec:
    n_head: int
    n_head_kv: int
    head_dim: int
    scale: float  # multiplies q.k
    eps: float  # of the q/k norms
    window: int = 0  # sliding window (0: full causal attention)
    softcap: float = 0.0  # tanh soft cap on the scores (0: none)


class Attention:
    """GQA self-attention with per-sequence KV caches."""

    def __init__(self, layer: int, weights: AttentionWeights, spec: AttentionSpec, rope: Rope):
        self.layer, self.w, self.spec, self.rope = layer, weights, spec, rope

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        w, s = self.w, self.spec
        q, k, v = w.wq(x), w.wk(x), w.wv(x)  # [N, H*E], [N, K*E], [N, K*E]
        if w.q_norm is not None and w.q_norm.shape[0] != s.head_dim:  # whole-projection norm
            q, k = rms_norm(q, w.q_norm, s.eps), rms_norm(k, w.k_norm, s.eps)
        q = q.view(-1, s.n_head, s.head_dim)  # [N, H, E]
        k = k.view(-1, s.n_head_kv, s.head_dim)  # [N, K, E]
        v = v.view(-1, s.n_head_kv, s.head_dim)  # [N, K, E]
        if w.q_norm is not None and w.q_norm.shape[0] == s.head_dim:  # per-head norm
            q, k = rms_norm(q, w.q_norm, s.eps), rms_norm(k, w.k_norm, s.eps)
        q, k = self.rope(q, batch.positions), self.rope(k, batch.positions)
        out = torch.empty_like(q)
        for (start, end), cache in zip(batch.spans, batch.caches):
            keys, values = cache.append(self.layer, k[start:end], v[start:end])  # [S, K, E]
            out[start:end] = attend(s, q[start:end], keys, values, cache.length, w.sinks)
        return w.wo(out.flatten(1))  # [N, D]


def attend(s: AttentionSpec, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           past: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, E] at positions past..past+T-1 against keys [S, K, E], values [S, K, V] -> [T, H, V].

    A sink is one more logit per head in the softmax, with no value (GPT-OSS).
    """
    n_new, n_all = q.shape[0], keys.shape[0]
    group = s.n_head // s.n_head_kv
    qg = q.view(n_new, s.n_head_kv, group, s.head_dim).permute(1, 2, 0, 3)  # [K, G, T, E]
    kt = keys.permute(1, 2, 0)[:, None]  # [K, 1, E, S]
    scores = (qg @ kt) * s.scale  # [K, G, T, S]
    if s.softcap:
        scores = torch.tanh(scores / s.softcap) * s.softcap
    q_pos = torch.arange(past, past + n_new)[:, None]  # [T, 1]
    k_pos = torch.arange(n_all)[None, :]  # [1, S]
    visible = k_pos <= q_pos
    if s.window:
        visible &= q_pos - k_pos < s.window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.view(s.n_head_kv, group, 1, 1).expand(-1, -1, n_new, 1)  # [K, G, T, 1]
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]  # [K, G, T, S]
    else:
        probs = torch.softmax(scores, dim=-1)  # [K, G, T, S]
    out = probs @ values.permute(1, 0, 2)[:, None]  # [K, G, T, V]
    return out.permute(2, 0, 1, 3).reshape(n_new, s.n_head, values.shape[-1])  # [T, H, V]


@dataclass
class DenseFFN:
    """Gated FFN: down(act(gate x) * up x); SiLU (SwiGLU) or tanh-GELU (GeGLU, Gemma)."""

    gate: Linear  # [N, D] -> [N, F]
    up: Linear  # [N, D] -> [N, F]
    down: Linear  # [N, F] -> [N, D]
    gelu: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)  # [N, F]
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down(g * self.up(x))  # [N, D]
