"""Turning user settings into store options: sizes like ``12GiB`` and the KV cache's share."""

from __future__ import annotations

import re

from moeswap.errors import MoeswapError
from moeswap.formats.config import ModelConfig

STEP_TOKENS = 512  # default tokens per forward: llama.cpp's n_ubatch

PREDICTORS = ("off", "gate", "history", "both")  # --prefetch: moeswap.experts.prefetch
# --miss-lowbit: the types a low-bit copy can take (moeswap.experts.lowbit); ggml quantizes
# each without an importance matrix.
LOWBIT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                "iq4_nl")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4,
          "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'12GiB', '512MiB', '1.5GB', '4096' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise MoeswapError(f"cannot read {text!r} as a size; write e.g. 512MiB, 12GiB or 4096")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def kv_bytes_per_token(config: ModelConfig) -> int:
    """Bytes one position costs when every layer keeps it: float32 keys and values of every
    layer (one latent for MLA; per layer type for Gemma 4). Sliding-window layers keep only
    their window: ``kv_cache_bytes`` is what a cache holds."""
    return 4 * config.kv_floats_per_token


def kv_cache_bytes(config: ModelConfig, context: int, sequences: int = 1,
                   step_tokens: int = 0) -> int:
    """Bytes of float32 keys and values the caches of ``sequences`` sequences of up to
    ``context`` positions hold, fed at most ``step_tokens`` tokens per forward (0: a whole
    context in one forward). Full-attention layers keep every position; a sliding-window
    layer keeps at most window - 1 + step_tokens (moeswap.models.blocks.KVCache)."""
    full, swa = config.kv_floats_per_token_by_kind
    step = step_tokens or context
    held_swa = min(context, config.sliding_window - 1 + step) if swa else 0
    return 4 * sequences * (full * context + swa * held_swa)


def forward_working_bytes(config: ModelConfig, tokens: int, context: int) -> int:
    """Bytes a forward of ``tokens`` fed tokens holds besides weights and caches, each token
    attending over up to ``context`` positions (float32, per fed token): its logits and their
    sampled copy 2V (the engine computes logits for every position), one layer's attention
    scores and softmax 2HC, and activations about 16D (residual, norms, q/k/v/o, router,
    expert inputs and outputs). V vocabulary, H query heads, C context, D model width."""
    per_token = 4 * (2 * config.n_vocab + 2 * config.n_head * context + 16 * config.n_embd)
    return tokens * per_token
