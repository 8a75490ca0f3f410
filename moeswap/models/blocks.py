"""Building blocks shared by every family: RMSNorm, RoPE, attention with a KV cache, dense FFN.

Math only: tensors in, tensors out. A forward pass runs a batch of sequences at once: their
tokens are concatenated along one axis (N = sum of the sequences' new tokens) for every
position-wise op, and attention runs per sequence against that sequence's own cache.

Legend used in shape comments: N tokens of the batch, T new tokens of one sequence,
S cached + new positions of one sequence (kept ones only, on sliding-window layers), C slots of
a layer's cache, D model width, H query heads, K kv heads, G = H / K query heads per kv head,
E head size (V: of the values, where it differs), R rotated dims per head, F FFN width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from moeswap.memory import held_positions
from moeswap.formats.rope_scaling import Yarn

# A ggml attention graph attends over whole spans of this many slots, masking unused ones, as
# llama.cpp pads its n_kv (moeswap.models.ggml_attention): an unbudgeted cache starts with one
# span, so that a short sequence's dot products over slots have llama.cpp's length.
SLOT_SPAN = 256
# A KVCache of this dtype holds Q8_0 blocks (34 bytes per 32 numbers, --kv-type q8_0): keys and
# values as rows of bytes, written and read by ggml's attention graphs alone (flash attention,
# as llama.cpp needs for a quantized V), never by the torch path.
KV_Q8_0 = torch.uint8
Q8_0_BLOCK, Q8_0_BLOCK_BYTES = 32, 34


# A linear layer as the model sees it: x [N, in] -> [N, out]. The loader picks the kind
# (moeswap.models.linear): a torch weight, or ggml kernels on the stored quantized bytes.
Linear = Callable[[torch.Tensor], torch.Tensor]
# A pre-norm layer's attention, with its norms and residual (and routing, and experts), as one
# ggml graph (moeswap.models.ggml_attention): x [N, D], batch -> LayerStep.
LayerGraph = Callable[[torch.Tensor, "Batch"], "LayerStep"]


@dataclass
class LayerStep:
    """What a layer graph gives for N tokens: h [N, D] and the FFN's input [N, D]; with routing
    the experts' ids [N, K] and weights [N, K]; where the FFN (dense, or the routed experts) ran
    in the graph too, the layer's output ``out`` [N, D] instead of h and the FFN's input."""

    h: torch.Tensor | None = None
    ffn_input: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    out: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (Gemma's +1 is already in weight),
    rounded as ggml's rms_norm: squares summed in float64, the rest in x's precision. A Q8_0
    product that follows then quantizes the very values llama.cpp quantizes (a one-ulp
    difference can cross a rounding step: 2.5e-2 on the tiny DeepSeek-V3's q8_0 logits)."""
    mean = (x * x).double().sum(-1, keepdim=True).div(x.shape[-1]).to(x.dtype)  # [..., 1]
    return x * (1.0 / torch.sqrt(mean + eps)) * weight


class KVCache:
    """Keys and values of one sequence, one buffer of slots per layer: [C, K, E].

    A full-attention layer (window 0) keeps every position in order. A sliding-window layer
    keeps a ring: a query at position p sees keys at p - window < k <= p, so once a step's
    new tokens are written only the last window - 1 positions can still be seen, and the
    ring needs min(length, window - 1) + T slots for a step of T new tokens (a chunked layer
    too: a query's chunk starts at most window - 1 positions back). Slots are
    reused in place (no copy per step). Every slot carries its absolute position, which
    ``attend`` masks with, so stale slots cost nothing but compute.

    A cache told the budget's ``context`` (and ``step_tokens``) sizes each layer's buffer
    once, at its first append, to exactly what moeswap.memory.kv_cache_bytes charges
    (``held_positions``), and never grows while the sequence stays inside them. Without a
    context a buffer doubles when a step needs more room (no budget to keep to); a ring then
    holds window - 1 + T positions rounded up to whole SLOT_SPANs.

    Each layer's entry shape is that of its first append, so layers may differ (MLA caches
    one latent per token: keys [S, 1, kv_lora + rope] and zero-width values).

    Keys and values are stored as ``dtype`` (torch.float16 for ``--kv-type f16``); ``attend``
    widens them back and rounds as ggml does against a cache of that type. ``KV_Q8_0`` (bytes
    of Q8_0 blocks) is for ggml graphs only.
    """

    def __init__(self, windows: Sequence[int], context: int = 0, step_tokens: int = 0,
                 dtype: torch.dtype = torch.float32):
        """windows: per layer, its sliding window (0: full attention); context: positions
        the budget charges each layer for (0: none, grow as needed), fed at most
        step_tokens per forward (0: a whole context); dtype: of the stored keys and values."""
        self.length = 0  # positions already processed
        self.dtype = dtype
        self.windows = tuple(windows)
        self.sizes = tuple(held_positions(w, context, step_tokens) if context else 0
                           for w in self.windows)
        self._layers: list[_LayerSlots | None] = [None] * len(self.windows)

    def append(self, layer: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store the new tokens' k, v [T, K, E] at positions length..length+T-1; return the
        kept keys [S, K, E], values [S, K, V] and their absolute positions [S]."""
        slots = self.room(layer, k.shape[0], k.shape[1:], v.shape[1:])
        slots.write(k, v, self.length)
        return slots.kept()

    def room(self, layer: int, n_new: int, key_shape: Sequence[int],
             value_shape: Sequence[int]) -> _LayerSlots:
        """The layer's slots with room for ``n_new`` positions after ``length`` (allocated on
        the first call with entries of key_shape [K, E] and value_shape [K, V]); the caller
        writes them (``append``, or a ggml graph through ``_LayerSlots.claim``)."""
        window = self.windows[layer]
        older = min(self.length, window - 1) if window else self.length  # still visible
        slots = self._layers[layer]
        if slots is None or slots.capacity < older + n_new:
            if self.sizes[layer]:  # the charged size; past it (a longer sequence) just enough
                capacity = max(self.sizes[layer], older + n_new)
            else:
                capacity = max(2 * (0 if slots is None else slots.capacity), SLOT_SPAN,
                               older + n_new)
                if window:  # whole slot spans: until it wraps, a ring's dot products have the
                    # length of llama.cpp's padded n_kv (its sums' lanes, so its bits)
                    capacity = min(capacity, -(-(window - 1 + n_new) // SLOT_SPAN) * SLOT_SPAN)
            slots = _LayerSlots(capacity, tuple(key_shape), tuple(value_shape), self.dtype, slots,
                                self.length - older, self.length)
            self._layers[layer] = slots
        return slots

    def n_floats(self) -> int:
        """Numbers held in written slots, keys and values of every layer: each committed
        position on full layers, at most window - 1 + the largest step's on sliding ones."""
        return sum(s.n_floats() for s in self._layers if s is not None)

    def advance(self, n_tokens: int) -> None:
        """Commit the tokens every layer has appended."""
        self.length += n_tokens

    def can_truncate(self, n_tokens: int) -> bool:
        """Whether ``truncate(n_tokens)`` is possible: every sliding-window ring still holds
        the window - 1 positions before n_tokens (it holds its last ``capacity`` written)."""
        return n_tokens <= self.length and all(
            s is None or not w or s.oldest <= max(0, n_tokens - w + 1)
            for w, s in zip(self.windows, self._layers))

    def truncate(self, n_tokens: int) -> None:
        """Forget the positions from ``n_tokens`` on: the server reuses a kept cache for a new
        prompt that shares only its first ``n_tokens``. Slots of later positions stay written
        until overwritten; ``attend`` masks them (a key after the query is never seen)."""
        if not self.can_truncate(n_tokens):
            raise ValueError(f"a sliding-window ring no longer holds the positions before "
                             f"{n_tokens}")
        self.length = n_tokens
        for slots in self._layers:
            if slots is not None:
                slots.end = min(slots.end, n_tokens)


class _LayerSlots:
    """One layer's slots: keys [C, K, E], values stored transposed [K, V, C] (as llama.cpp's
    v_trans, so a ggml product reads each value row contiguously), positions [C]; of a Q8_0
    cache, keys and values both as rows of blocks [C, K*E/32*34] bytes (a block is 32
    numbers of a row, so values cannot be transposed: ggml's flash attention reads rows). Position p
    lives in slot (p - base) % C, so a step that is run again after a failure rewrites the same
    slots. Buffers start zeroed: a ggml graph attends over whole padded spans of slots, masking
    the unwritten ones, and a zero never turns a masked score into NaN."""

    def __init__(self, capacity: int, key_shape: tuple[int, ...], value_shape: tuple[int, ...],
                 dtype: torch.dtype, old: _LayerSlots | None, first_kept: int, length: int):
        """Room for ``capacity`` positions, holding positions first_kept..length-1 of ``old``."""
        self.capacity, self.base, self.end = capacity, first_kept, first_kept
        self.frontier = first_kept  # one past the latest position ever written (>= end)
        self.numbers_per_slot = math.prod(key_shape) + math.prod(value_shape)
        self.rows = dtype == KV_Q8_0  # values as rows of Q8_0 blocks, not transposed
        if self.rows:
            self.keys = torch.zeros(capacity, _q8_0_bytes(key_shape), dtype=dtype)  # [C, bytes]
            self.values = torch.zeros(capacity, _q8_0_bytes(value_shape), dtype=dtype)
        else:
            self.keys = torch.zeros((capacity, *key_shape), dtype=dtype)  # [C, K, E]
            self.values = torch.zeros((*value_shape, capacity), dtype=dtype)  # [K, V, C]
        self.positions = torch.zeros(capacity, dtype=torch.long)
        self._positions = self.positions.numpy()  # the same memory: numpy's writes cost less
        if old is not None and length > first_kept:
            at, n = old.slots(first_kept, length), length - first_kept  # oldest first
            self.keys[:n] = old.keys[at]  # [n, K, E]
            if self.rows:
                self.values[:n] = old.values[at]  # [n, bytes]
            else:
                self.values[..., :n] = old.values[..., at]  # [K, V, n]
            self.positions[:n] = old.positions[at]  # [n]
            self.end = self.frontier = length

    def slots(self, first: int, end: int) -> slice | torch.Tensor:
        """Where positions first..end-1 live: a slice when they do not wrap (the common
        case), else their slots [end - first]."""
        start = (first - self.base) % self.capacity
        if start + end - first <= self.capacity:
            return slice(start, start + end - first)
        return (torch.arange(first, end) - self.base) % self.capacity

    def claim(self, first: int, n_new: int) -> slice | torch.Tensor:
        """Mark positions first..first+n_new-1 as written -> their slots; the caller writes
        their keys and values there."""
        at = self.slots(first, first + n_new)
        where = at if isinstance(at, slice) else at.numpy()
        self._positions[where] = first if n_new == 1 else np.arange(first, first + n_new)
        self.end = first + n_new
        self.frontier = max(self.frontier, self.end)
        return at

    def write(self, k: torch.Tensor, v: torch.Tensor, first: int) -> None:
        """k [T, K, E], v [T, K, V] at positions first..first+T-1 (cast to the slots' type)."""
        if self.rows:
            raise RuntimeError("a Q8_0 KV cache is written by ggml attention graphs only")
        at = self.claim(first, k.shape[0])
        self.keys[at] = k.to(self.keys.dtype)
        self.values[..., at] = v.permute(1, 2, 0).to(self.values.dtype)  # [K, V, T]

    @property
    def oldest(self) -> int:
        """The first position still held: the slots hold the last ``capacity`` written."""
        return max(self.base, self.frontier - self.capacity)

    @property
    def filled(self) -> int:
        return min(self.end - self.base, self.capacity)

    def kept(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.filled
        return self.keys[:n], self.values[..., :n].permute(2, 0, 1), self.positions[:n]

    def n_floats(self) -> int:
        return self.filled * self.numbers_per_slot


def _q8_0_bytes(shape: Sequence[int]) -> int:
    """Bytes of one slot's numbers of ``shape`` as Q8_0 blocks (a multiple of 32 numbers)."""
    return math.prod(shape) // Q8_0_BLOCK * Q8_0_BLOCK_BYTES


@dataclass
class Batch:
    """Where each sequence's new tokens sit in the concatenated batch, and their caches."""

    positions: torch.Tensor  # [N] absolute position of every token
    spans: list[tuple[int, int]]  # per sequence: [start, end) into the N axis
    caches: list[KVCache]
    # What every layer of one slot layout shares within this forward (attention masks, slot
    # indices), made by the first layer that needs it (moeswap.models.ggml_attention).
    shared: dict[Any, Any] = field(default_factory=dict)


class Rope:
    """Rotary position embedding: llama.cpp's NORM (adjacent pairs) or NeoX (halves) layout,
    with linear or YaRN scaling (ggml's rope_yarn: per pair, blend the interpolated and the
    original frequency along a ramp over the correction dims; cos/sin times yarn.mscale)."""

    def __init__(self, n_rot: int, base: float, scale: float, neox: bool,
                 freq_factors: torch.Tensor | None = None, yarn: Yarn | None = None,
                 mscale: float = 1.0):
        """mscale: the cos/sin multiplier without YaRN (YaRN brings its own)."""
        # As given, for ggml's rope_ext (moeswap.models.ggml_attention), which takes no YaRN here.
        self.base, self.scale, self.freq_factors, self.yarn = base, scale, freq_factors, yarn
        exponents = torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot
        inv_freq = base ** -exponents  # [R/2]
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(torch.float64)
        self.inv_freq = inv_freq / scale
        self.mscale = mscale
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
    chunked: bool = False  # the window is an aligned chunk, not a sliding window (Llama 4)
    softcap: float = 0.0  # tanh soft cap on the scores (0: none)
    # The scale multiplies q before q.k (llama.cpp's Gemma 3 and Phi-3 graphs scale Qcur, kq_scale
    # 1), so an f16 cache rounds the scaled q; otherwise the softmax scales the f16 dot products.
    scale_q: bool = False


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
        q, k = self.place(q, k, batch.positions)
        out = torch.empty_like(q)
        for (start, end), cache in zip(batch.spans, batch.caches):
            keys, values, k_pos = cache.append(self.layer, k[start:end], v[start:end])  # [S, K, E]
            out[start:end] = attend(s, q[start:end], keys, values, cache.length, k_pos, w.sinks)
        return w.wo(out.flatten(1))  # [N, D]

    def place(self, q: torch.Tensor, k: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where positions enter: RoPE on q [N, H, E] and k [N, K, E] (a family may differ)."""
        return self.rope(q, positions), self.rope(k, positions)


def attend(s: AttentionSpec, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           past: int, k_pos: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, E] at positions past..past+T-1 against keys [S, K, E], values [S, K, V] at
    positions k_pos [S] (any order) -> [T, H, V]. A query at p sees keys at k <= p, and with a
    window only p - k < window (llama.cpp's is_masked_swa: masked when p - k >= n_swa), or
    with chunks only k in p's chunk (LLAMA_SWA_TYPE_CHUNKED: k >= p // window * window).

    A sink is one more logit per head in the softmax, with no value (GPT-OSS).

    Keys and values narrower than q (an f16 cache) are widened, and q and the probabilities
    are rounded to their type first: ggml's CPU mul_mat converts its f32 operand to the cache's
    type before each dot product (llama.cpp's attention without flash attention).
    """
    if s.scale_q:
        q = q * s.scale  # [T, H, E]
    narrow = keys.dtype if keys.dtype != q.dtype else None
    if narrow is not None:
        q = q.to(narrow).to(q.dtype)  # [T, H, E], rounded as ggml rounds it
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # [S, K, E], [S, K, V]
    n_new, n_keys = q.shape[0], keys.shape[0]
    group = s.n_head // s.n_head_kv
    qg = q.view(n_new, s.n_head_kv, group, s.head_dim).permute(1, 2, 0, 3)  # [K, G, T, E]
    kt = keys.permute(1, 2, 0)[:, None]  # [K, 1, E, S]
    # One buffer holds the scores and then the probabilities, every step writing in place
    # (inference: nothing keeps a graph); a sink is its rows' last number (S + 1 wide).
    width = n_keys + (sinks is not None)
    logits = q.new_empty((s.n_head_kv, group, n_new, width))  # [K, G, T, S (+ 1)]
    rows = s.n_head * n_new
    scores = logits.view(-1)[:rows * n_keys].view(s.n_head_kv, group, n_new, n_keys)  # packed
    torch.matmul(qg, kt, out=scores)  # [K, G, T, S]
    if not s.scale_q:
        scores.mul_(s.scale)
    if s.softcap:
        scores.div_(s.softcap).tanh_().mul_(s.softcap)
    visible = visible_keys(torch.arange(past, past + n_new), k_pos, s.window, s.chunked)
    scores.masked_fill_(~visible, float("-inf"))
    if sinks is not None:
        _spread_rows(logits.view(-1), rows, n_keys)
        logits[..., n_keys] = sinks.view(s.n_head_kv, group, 1)
    torch.softmax(logits, dim=-1, out=logits)
    probs = logits[..., :n_keys]  # [K, G, T, S]: a sink's share goes to no value
    if narrow is not None:
        probs = probs.to(narrow).to(q.dtype)  # [K, G, T, S], rounded as ggml rounds them
    out = probs @ values.permute(1, 0, 2)[:, None]  # [K, G, T, V]
    return out.permute(2, 0, 1, 3).reshape(n_new, s.n_head, values.shape[-1])  # [T, H, V]


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int,
                 chunked: bool) -> torch.Tensor:
    """Queries at q_pos [T] against keys at k_pos [S] -> [T, S] bool, ``attend``'s rule: a key
    at k <= p, within the sliding window (p - k < window) or the query's chunk (torch tensors
    or numpy arrays)."""
    q_pos, k_pos = q_pos[:, None], k_pos[None, :]  # [T, 1], [1, S]
    visible = k_pos <= q_pos
    if window and chunked:
        visible &= k_pos >= q_pos // window * window
    elif window:
        visible &= q_pos - k_pos < window
    return visible


def _spread_rows(flat: torch.Tensor, rows: int, width: int) -> None:
    """Move ``rows`` rows of ``width`` numbers packed at the start of ``flat`` apart to a
    stride of width + 1, in place: last rows first, so no row is overwritten before it
    moves, in 16 blocks, each copied through a temporary of its size (1/16 of the rows)."""
    block = -(-rows // 16)
    for end in range(rows, 0, -block):
        start = max(end - block, 0)
        packed = flat[start * width:end * width].view(end - start, width)
        spread = flat[start * (width + 1):end * (width + 1)].view(end - start, width + 1)
        spread[:, :width] = packed.clone()  # the two may overlap


@dataclass
class DenseFFN:
    """Gated FFN: down(act(gate x) * up x); SiLU (SwiGLU) or tanh-GELU (GeGLU, Gemma)."""

    gate: Linear  # [N, D] -> [N, F]
    up: Linear  # [N, D] -> [N, F]
    down: Linear  # [N, F] -> [N, D]
    gelu: bool = False
    # The same as one ggml graph (moeswap.models.ggml_ffn), where the loader could build one.
    graph: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            return self.graph(x)
        g = self.gate(x)  # [N, F]
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down(g * self.up(x))  # [N, D]
