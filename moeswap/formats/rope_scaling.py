"""RoPE parameters as HF configs (transformers') and, for YaRN scaling, GGUF metadata (llama.cpp's
reading) describe them: the parameters only; ``models.blocks.Rope`` computes with them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from moeswap.errors import MoeswapError


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (GPT-OSS, DeepSeek-V2): frequencies blend interpolated (/ factor) and
    original values along a ramp between the correction dims of beta_fast and beta_slow."""

    factor: float
    orig_ctx: int  # the pre-training context the correction dims are computed for
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # floor/ceil the correction dims (llama.cpp always does)
    mscale: float = 1.0  # cos/sin multiplier ("attention factor")


def llama3_factors(params: dict[str, Any], dim: int) -> tuple[float, ...]:
    """Llama 3 scaling's per-pair frequency divisors, as llama.cpp's converter writes them into
    ``rope_freqs`` (LlamaModel.generate_extra_tensors) and transformers'
    _compute_llama3_parameters divides by: 1 for short wavelengths, ``factor`` for long ones, a
    smooth blend between."""
    base = params.get("rope_theta", 10000.0)
    factor = params.get("factor", 8.0)
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    orig = params.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < orig / high:
            factors.append(1.0)
        elif wavelen > orig / low:
            factors.append(float(factor))
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1 * mscale * ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_from_gguf(path: Any, key: Callable[..., Any], arch: str) -> Yarn | None:
    """llama.cpp's YaRN: cos/sin times mscale(factor) * rope.scaling.attn_factor (DeepSeek-V2
    with a log multiplier keeps attn_factor alone: ``families.deepseek2``)."""
    factor = float(key("rope.scaling.factor", 0.0) or 0.0)
    if factor <= 1.0:
        return None
    orig_ctx = key("rope.scaling.original_context_length")
    if not orig_ctx:
        raise MoeswapError(f"{path}: YaRN RoPE scaling without "
                           f"'{arch}.rope.scaling.original_context_length'")
    return Yarn(factor, int(orig_ctx), float(key("rope.scaling.yarn_beta_fast", 32.0)),
                float(key("rope.scaling.yarn_beta_slow", 1.0)), True,
                yarn_mscale(factor) * float(key("rope.scaling.attn_factor", 1.0)))


def hf_rope_parameters(hf: dict[str, Any], kind: str) -> dict[str, Any]:
    """RoPE parameters for 'full_attention' or 'sliding_attention' (transformers 4 and 5 layouts)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and kind in params:
        return params[kind]
    if isinstance(params, dict) and "rope_theta" in params:
        return params
    legacy = dict(hf.get("rope_scaling") or {})
    legacy.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "type" in legacy:  # transformers 4 named it "type" (DeepSeek-V2-Lite's config.json)
        legacy.setdefault("rope_type", legacy["type"])
    if kind == "sliding_attention" and "rope_local_base_freq" in hf:
        legacy = {"rope_theta": hf["rope_local_base_freq"]}
    return legacy


def yarn_from_hf(params: dict[str, Any], hf: dict[str, Any]) -> Yarn:
    """transformers' _compute_yarn_parameters."""
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor") or hf["max_position_embeddings"] / orig
    mscale = params.get("attention_factor")
    if mscale is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            mscale = yarn_mscale(factor, params["mscale"]) / yarn_mscale(factor, params["mscale_all_dim"])
        else:
            mscale = yarn_mscale(factor)
    return Yarn(float(factor), int(orig), float(params.get("beta_fast") or 32.0),
                float(params.get("beta_slow") or 1.0), bool(params.get("truncate", True)), float(mscale))
