"""GLM-4.5 / 4.6 (GGUF arch glm4moe): sigmoid routing with the selection bias, a shared expert,
leading dense layers, partial NeoX RoPE, Q/K/V biases and optional per-head q/k norms; the
multi-token-prediction (MTP) layers skipped, as llama.cpp's graph skips them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from moeswap.errors import MoeswapError
from moeswap.formats.families.hooks import FamilyHooks


def gguf_fields(path: Any, key: Callable[..., Any], fields: dict[str, Any]) -> None:
    # block_count counts the MTP layers too; llama.cpp's graph runs the first n_layer only.
    nextn = int(key("nextn_predict_layers", 0))
    fields["n_layer"] -= nextn
    n_layer, n_ff_exp = fields["n_layer"], fields["n_ff_exp"]
    if isinstance(fields["n_ff"], list):  # per-layer arrays cover the MTP layers too
        fields["n_ff"] = fields["n_ff"][:n_layer]
    if isinstance(n_ff_exp, list):  # ... and the dense lead, whose entries may be 0
        fields["n_ff_exp"] = n_ff_exp[fields["n_layer_dense_lead"]:n_layer]
    gating = int(key("expert_gating_func", 0))
    if gating not in (0, 2):  # llama.cpp: absent means sigmoid for glm4moe
        raise MoeswapError(f"{path}: expert_gating_func={gating} is not supported for glm4moe "
                           "(supported: 2 sigmoid, as GLM-4.5 / 4.6 publish it)")


def hf_fields(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    """transformers' Glm4MoeForCausalLM: layers from num_hidden_layers on are the MTP ones
    (the folder loader skips them); the router is always sigmoid (ARCH_TRAITS) with the
    selection bias."""
    if not hf.get("n_routed_experts"):
        raise MoeswapError(f"{folder}/config.json: GLM-4.5 without routed experts is not supported")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    fields.update(head_dim=head_dim, n_rot=int(head_dim * factor),
                  n_layer_dense_lead=hf.get("first_k_dense_replace") or 0,
                  expert_weights_norm=bool(hf.get("norm_topk_prob", True)))
    if fields["n_layer_dense_lead"]:  # the leading dense layers' FFN width
        fields["n_ff"] = hf["intermediate_size"]
    n_group, topk_group = hf.get("n_group", 1), hf.get("topk_group", 1)
    if n_group and topk_group and topk_group < n_group:  # else every group is kept
        fields.update(n_expert_groups=n_group, n_expert_groups_used=topk_group)


HOOKS = FamilyHooks(gguf_fields=gguf_fields, hf_fields=hf_fields,
                    hf_layer_norms={"post_attention_layernorm": "post_attention_norm"})
