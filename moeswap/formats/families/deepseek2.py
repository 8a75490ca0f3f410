"""DeepSeek-V2 / V2-Lite / V3 / R1 and Kimi-K2: the variants moeswap computes, MLA's sizes, the
routing (softmax or sigmoid, expert groups) and YaRN's mscale in the attention scale."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

from moeswap.errors import MoeswapError
from moeswap.formats.families.hooks import FamilyHooks
from moeswap.formats.rope_scaling import hf_rope_parameters, yarn_mscale


# llama.cpp's expert_gating_func values that moeswap computes (llama_expert_gating_func_type).
_GATING = {1: "softmax", 2: "sigmoid"}


def gguf_fields(path: Any, key: Callable[..., Any], fields: dict[str, Any]) -> None:
    _check_gguf(path, key)
    fields["gating"] = _gguf_gating(path, key, fields)
    yarn = fields["yarn"]
    if yarn:  # llama.cpp's deepseek2 loader ignores the beta keys (Kimi-K2 writes 1 / 1)
        yarn = fields["yarn"] = dataclasses.replace(yarn, beta_fast=32.0, beta_slow=1.0)
    log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1  # the converter's 0.1x
    if yarn and log_mul:  # llama.cpp then takes mscale = mscale_all_dim: cos/sin ratio 1
        yarn = fields["yarn"] = dataclasses.replace(
            yarn, mscale=float(key("rope.scaling.attn_factor", 1.0)))
    # MLA runs as MQA over the latent: key_length is the cached width, the scale uses
    # the decompressed per-head key size, times YaRN's mscale(mscale_all_dim) squared.
    mscale = yarn_mscale(yarn.factor, log_mul) if yarn else 1.0
    fields["attention_scale"] = mscale * mscale / math.sqrt(int(key("attention.key_length_mla")))


def _gguf_gating(path: Any, key: Callable[..., Any], fields: dict[str, Any]) -> str:
    """llama.cpp's deepseek2 loader: an absent (or 0) key means softmax (DeepSeek-V2 files
    predate it), except GLM-4.7-Lite's shape (47 or 48 layers, 154880 tokens): sigmoid."""
    gating = int(key("expert_gating_func", 0))
    if gating == 0:
        glm_lite = fields["n_layer"] in (47, 48) and fields["n_vocab"] == 154880
        return "sigmoid" if glm_lite else "softmax"
    if gating not in _GATING:
        raise MoeswapError(f"{path}: expert_gating_func={gating} is not supported for deepseek2 "
                           "(supported: 1 softmax, as in DeepSeek-V2; 2 sigmoid, as in V3 and Kimi-K2)")
    return _GATING[gating]


def _check_gguf(path: Any, key: Callable[..., Any]) -> None:
    if not key("attention.key_length_mla"):
        raise MoeswapError(f"{path}: key 'deepseek2.attention.key_length_mla' is missing; "
                           "files with the old fused attn_kv_b tensor are not supported, "
                           "reconvert with a current convert_hf_to_gguf.py")


def hf_fields(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    _check_hf(hf, folder)
    # MLA: the cache holds one latent (kv_lora_rank + rope dims) per token.
    fields.update(head_dim=hf["kv_lora_rank"] + hf["qk_rope_head_dim"], n_head_kv=1,
                  n_rot=hf["qk_rope_head_dim"],
                  q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                  head_dim_k_mla=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
                  head_dim_v_mla=hf["v_head_dim"])
    # YaRN's mscale(mscale_all_dim) squared joins the softmax scale (yarn_apply_mscale).
    full = hf_rope_parameters(hf, "full_attention")
    mscale_all = full.get("mscale_all_dim", 0) if full.get("rope_type") == "yarn" else 0
    mscale = yarn_mscale(full.get("factor", 1.0), mscale_all) if mscale_all else 1.0
    fields["attention_scale"] = mscale * mscale * fields["head_dim_k_mla"] ** -0.5
    fields["n_layer_dense_lead"] = hf.get("first_k_dense_replace") or 0
    if fields["n_layer_dense_lead"]:  # the leading dense layers' FFN width
        fields["n_ff"] = hf["intermediate_size"]
    fields["expert_weights_norm"] = hf.get("norm_topk_prob")  # absent: the architecture's default
    if _is_v3(hf):
        _v3_routing(hf, folder, fields)


def _is_v3(hf: dict[str, Any]) -> bool:
    return "DeepseekV3ForCausalLM" in (hf.get("architectures") or [])


def _v3_routing(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    """transformers' DeepseekV3TopkRouter: sigmoid scores whatever scoring_func says, the
    selection bias e_score_correction_bias, n_group / topk_group always (defaults 8 / 4)."""
    score_func = hf.get("scoring_func")
    if score_func not in (None, "sigmoid"):  # llama.cpp's converter would write it; transformers ignores it
        raise MoeswapError(f"{folder}/config.json: scoring_func '{score_func}' with "
                           "DeepseekV3ForCausalLM: transformers computes sigmoid, llama.cpp would "
                           "compute the GGUF with the config's function")
    n_group, topk_group = hf.get("n_group", 8), hf.get("topk_group", 4)
    fields["gating"] = "sigmoid"
    if fields["expert_weights_norm"] is None:
        fields["expert_weights_norm"] = True  # DeepseekV3Config's default
    if n_group and topk_group and topk_group < n_group:  # else every group is kept
        fields.update(n_expert_groups=n_group, n_expert_groups_used=topk_group)


def _check_hf(hf: dict[str, Any], folder: Path) -> None:
    if not _is_v3(hf) and hf.get("topk_method", "greedy") != "greedy" and (hf.get("n_group") or 1) > 1:
        raise MoeswapError(f"{folder}/config.json: topk_method '{hf['topk_method']}' with "
                           f"n_group={hf['n_group']} is not supported (supported: greedy, as in "
                           "DeepSeek-V2-Lite); llama.cpp scores a group by its top two experts, transformers' "
                           "DeepseekV2 by its best one")
    if not hf.get("n_routed_experts"):
        raise MoeswapError(f"{folder}/config.json: DeepSeek-V2 without routed experts "
                           "is not supported")


HOOKS = FamilyHooks(gguf_fields=gguf_fields, hf_fields=hf_fields)
