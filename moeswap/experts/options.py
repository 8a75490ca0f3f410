"""Turning user settings into store options: sizes like ``12GiB`` and the KV cache's share."""

from __future__ import annotations

import re

from moeswap.errors import MoeswapError
from moeswap.formats.config import ModelConfig

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
    """Bytes the KV cache holds per position: float32 keys and values of every layer (one
    latent for MLA; per layer type for Gemma 4)."""
    return 4 * config.kv_floats_per_token
