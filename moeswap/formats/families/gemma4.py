"""Gemma 4 (the 26B-A4B MoE and 31B dense layouts): two layer types with their own head
sizes and kv heads, scales llama.cpp hard-codes, and Gemma 3's sandwich norms (used as stored,
without the +1)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from moeswap.errors import MoeswapError
from moeswap.formats.families.gemma3 import SANDWICH_NORMS
from moeswap.formats.families.hooks import LAYER_TENSORS, FamilyHooks
from moeswap.formats.rope_scaling import hf_rope_parameters


def gguf_fields(path: Any, key: Callable[..., Any], fields: dict[str, Any]) -> None:
    if key("embedding_length_per_layer_input", 0) or key("attention.shared_kv_layers", 0):
        raise MoeswapError(f"{path}: Gemma 4 with per-layer embeddings or shared KV layers "
                           "(E2B / E4B) is not supported; the 26B MoE and 31B layouts are")
    kv_heads = fields["n_head_kv"]
    if isinstance(kv_heads, list):  # one value per layer: sliding layers may differ from global
        sliding = fields["swa_layers"]
        fields["n_head_kv_swa"] = [n for n, s in zip(kv_heads, sliding) if s]
        fields["n_head_kv"] = [n for n, s in zip(kv_heads, sliding) if not s]
    fields["embedding_scale"] = math.sqrt(fields["n_embd"])  # hard-coded in llama.cpp
    fields["attention_scale"] = 1.0


def hf_fields(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    """Global layers may have larger heads and fewer kv heads than sliding ones; the MoE block
    is switched on by enable_moe_block, beside a dense FFN that every layer has."""
    if hf.get("hidden_size_per_layer_input") or hf.get("num_kv_shared_layers"):
        raise MoeswapError(f"{folder}/config.json: Gemma 4 with per-layer embeddings or shared "
                           "KV layers (E2B / E4B) is not supported; the 26B MoE and 31B layouts are")
    # "vision" makes only image tokens attend both ways: text alone stays causal.
    if hf.get("use_double_wide_mlp") or hf.get("use_bidirectional_attention") == "all":
        raise MoeswapError(f"{folder}/config.json: Gemma 4 with use_double_wide_mlp or "
                           "use_bidirectional_attention 'all' is not supported")
    per_layer = hf.get("per_layer_config") or {}
    full = next((per_layer.get(str(i), {}) for i, s in enumerate(fields["swa_layers"]) if not s), {})
    head_dim_full = hf.get("global_head_dim") or full.get("head_dim") or hf["head_dim"]
    full_rope = hf_rope_parameters(hf, "full_attention")
    if full_rope.get("rope_type", "default") not in ("default", "proportional"):
        raise MoeswapError(f"{folder}/config.json: Gemma 4 global RoPE "
                           f"'{full_rope['rope_type']}' is not supported (supported: proportional)")
    n_expert = hf["num_experts"] if hf.get("enable_moe_block") else 0
    fields.update(head_dim=head_dim_full, n_rot=head_dim_full, head_dim_swa=hf["head_dim"],
                  n_head_kv=full.get("num_key_value_heads") or hf["num_key_value_heads"],
                  n_head_kv_swa=hf["num_key_value_heads"],
                  rope_partial=float(full_rope.get("partial_rotary_factor", 1.0)),
                  n_ff=hf["intermediate_size"],
                  n_expert=n_expert,
                  n_expert_used=fields["n_expert_used"] if n_expert else 0,
                  n_ff_exp=hf["moe_intermediate_size"] if n_expert else 0,
                  attention_scale=1.0,  # q and k are RMS-normed instead
                  embedding_scale=hf["hidden_size"] ** 0.5)


HOOKS = FamilyHooks(gguf_fields=gguf_fields, hf_fields=hf_fields, hf_layer_types=True,
                    hf_layer_norms=SANDWICH_NORMS,
                    # global layers may use the key projection as values (no attn_v)
                    gguf_layer_tensors=tuple(c for c in LAYER_TENSORS if "attn_v" not in c))
