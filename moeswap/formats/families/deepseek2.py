"""DeepSeek-V2 / V2-Lite: the variants moeswap computes, MLA's sizes, and YaRN's mscale in the
attention scale."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

from moeswap.errors import MoeswapError
from moeswap.formats.families.hooks import FamilyHooks
from moeswap.formats.rope_scaling import hf_rope_parameters, yarn_mscale


def gguf_fields(path: Any, key: Callable[..., Any], fields: dict[str, Any]) -> None:
    _check_gguf(path, key)
    yarn = fields["yarn"]
    log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1  # the converter's 0.1x
    if yarn and log_mul:  # llama.cpp then takes mscale = mscale_all_dim: cos/sin ratio 1
        yarn = fields["yarn"] = dataclasses.replace(
            yarn, mscale=float(key("rope.scaling.attn_factor", 1.0)))
    # MLA runs as MQA over the latent: key_length is the cached width, the scale uses
    # the decompressed per-head key size, times YaRN's mscale(mscale_all_dim) squared.
    mscale = yarn_mscale(yarn.factor, log_mul) if yarn else 1.0
    fields["attention_scale"] = mscale * mscale / math.sqrt(int(key("attention.key_length_mla")))


def _check_gguf(path: Any, key: Callable[..., Any]) -> None:
    """The DeepSeek-V2 variants moeswap computes: softmax gating, no expert groups."""
    gating = key("expert_gating_func", 1)
    if gating not in (0, 1):  # 0: unset, llama.cpp's default for V2 is softmax
        raise MoeswapError(f"{path}: expert_gating_func={gating} is not supported for deepseek2 "
                           "(supported: 1, softmax, as in DeepSeek-V2 / V2-Lite)")
    if int(key("expert_group_count", 0)) > 1:
        raise MoeswapError(f"{path}: grouped expert selection (expert_group_count > 1) "
                           "is not supported")
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


def _check_hf(hf: dict[str, Any], folder: Path) -> None:
    if hf.get("topk_method", "greedy") != "greedy" and (hf.get("n_group") or 1) > 1:
        raise MoeswapError(f"{folder}/config.json: topk_method '{hf['topk_method']}' with "
                           f"n_group={hf['n_group']} is not supported (supported: greedy, as in "
                           "DeepSeek-V2-Lite); llama.cpp's converter drops the groups, changing the routing")
    if not hf.get("n_routed_experts"):
        raise MoeswapError(f"{folder}/config.json: DeepSeek-V2 without routed experts "
                           "is not supported")


HOOKS = FamilyHooks(gguf_fields=gguf_fields, hf_fields=hf_fields)
