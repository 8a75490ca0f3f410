"""Qwen2-MoE: every layer MoE; the HF config says whether the top-k weights are renormalised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeswap.errors import MoeswapError
from moeswap.formats.families.hooks import FamilyHooks


def hf_fields(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise MoeswapError(f"{folder}/config.json: Qwen2-MoE with dense layers "
                           "(mlp_only_layers / decoder_sparse_step) is not supported")
    fields["expert_weights_norm"] = hf.get("norm_topk_prob")  # absent: the architecture's default


HOOKS = FamilyHooks(hf_fields=hf_fields)
