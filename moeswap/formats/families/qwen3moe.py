"""Qwen3-MoE and OLMoE: the HF config says whether the top-k weights are renormalised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeswap.formats.families.hooks import FamilyHooks


def hf_fields(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    fields["expert_weights_norm"] = hf.get("norm_topk_prob")  # absent: the architecture's default


HOOKS = FamilyHooks(hf_fields=hf_fields)
