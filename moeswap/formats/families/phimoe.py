"""Phi-3.5-MoE (GGUF arch phimoe). llama.cpp and transformers compute it differently, on
purpose, and moeswap follows each for its own files (docs/ARCHITECTURES.md):

- norms: llama.cpp's phimoe graph takes RMS norm plus the bias (LLM_NORM_RMS with a bias
  tensor); transformers' PhimoeDecoderLayer takes LayerNorm (``layer_norm``);
- routing: llama.cpp takes a softmax over all experts, its top 2 renormalised; transformers'
  sparsemixer weighs each of the top 2 logits by a softmax over the logits near it, about 1
  each (``gating`` "sparsemixer", ``router_jitter``);
- LongRoPE: llama.cpp multiplies cos/sin by the converter's ``rope.scaling.attn_factor`` and
  takes the long factors when its context exceeds ``rope.scaling.original_context_length``;
  transformers multiplies by ``short_mscale`` and takes the short factors at every length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moeswap.errors import MoeswapError
from moeswap.formats.families.hooks import FamilyHooks
from moeswap.formats.rope_scaling import hf_rope_parameters


def gguf_fields(path: Any, key: Callable[..., Any], fields: dict[str, Any]) -> None:
    # llama.cpp's phimoe experts are feed_forward_length wide; no layer is dense.
    if not fields["n_ff_exp"]:
        fields["n_ff_exp"], fields["n_ff"] = fields["n_ff"], 0
    # llama.cpp's phimoe loader never reads the sliding window the converter writes, and its
    # graph hard-codes the routing: softmax, top-k renormalised, unscaled.
    fields.update(sliding_window=0, swa_layers=(), expert_weights_norm=True,
                  expert_weights_scale=1.0, n_expert_groups=0, n_expert_groups_used=0)
    fields["rope_mscale"] = float(key("rope.scaling.attn_factor", 1.0))
    fields["rope_orig_ctx"] = int(key("rope.scaling.original_context_length", 0)
                                  or fields["n_ctx_train"])


def hf_fields(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    """transformers' PhimoeForCausalLM: LayerNorm, sparsemixer, LongRoPE's short factors."""
    if hf.get("num_experts_per_tok", 2) != 2:
        raise MoeswapError(f"{folder}/config.json: num_experts_per_tok="
                           f"{hf['num_experts_per_tok']}: transformers' sparsemixer picks 2 experts "
                           "whatever it says, llama.cpp would pick that many; only 2 is supported")
    fields.update(layer_norm=True, gating="sparsemixer", expert_weights_norm=False,
                  router_jitter=float(hf.get("router_jitter_noise", 0.01)))
    rope = hf_rope_parameters(hf, "full_attention")
    if rope.get("rope_type", "default") in ("longrope", "su"):
        short, long = rope["short_mscale"], rope["long_mscale"]
        if short != long:  # transformers switches per forward on its longest position
            raise MoeswapError(f"{folder}/config.json: short_mscale {short} and long_mscale {long} "
                               "differ; moeswap applies one (Phi-3.5-MoE publishes them equal)")
        factors = tuple(float(f) for f in rope["short_factor"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if len(factors) != head_dim // 2:
            raise MoeswapError(f"{folder}/config.json: short_factor has {len(factors)} values, "
                               f"expected one per rotated pair ({head_dim // 2})")
        fields.update(rope_mscale=float(short), rope_factors=factors)


@dataclass(frozen=True)
class ConverterLongRope:
    """What llama.cpp's converter (Phi3MiniModel) writes for LongRoPE."""

    orig_ctx: int  # rope.scaling.original_context_length
    attn_factor: float | None  # rope.scaling.attn_factor; None: no long factors, not written
    short: tuple[float, ...]  # rope_factors_short.weight
    long: tuple[float, ...]  # rope_factors_long.weight


def converter_long_rope(hf: dict[str, Any], folder: Path) -> ConverterLongRope:
    """The converter's attn_factor is sqrt(1 + ln(scale) / ln(original)), scale =
    max_position_embeddings / original context: LongRoPE's default, not the config's mscale."""
    rope = hf_rope_parameters(hf, "full_attention")
    orig = int(rope.get("original_max_position_embeddings")
               or hf["original_max_position_embeddings"])
    if not rope.get("long_factor"):
        return ConverterLongRope(orig, None, (), ())
    if rope.get("rope_type") not in ("longrope", "su"):
        raise MoeswapError(f"{folder}/config.json: RoPE scaling '{rope.get('rope_type')}' with "
                           "long_factor is not supported for Phi-3.5-MoE (supported: longrope)")
    scale = hf["max_position_embeddings"] / orig
    attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    return ConverterLongRope(orig, attn_factor, tuple(rope["short_factor"]), tuple(rope["long_factor"]))


HOOKS = FamilyHooks(gguf_fields=gguf_fields, hf_fields=hf_fields)
