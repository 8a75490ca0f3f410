"""Granite-MoE: IBM's multipliers replace the usual scales; Q/K rows permuted as for llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeswap.errors import MoeswapError
from moeswap.formats.families.hooks import FamilyHooks


def hf_fields(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    if hf.get("head_dim"):
        raise MoeswapError(f"{folder}/config.json: Granite with head_dim is not supported "
                           "(llama.cpp ignores it too)")
    fields["attention_scale"] = hf.get("attention_multiplier") or 0.0
    fields["embedding_scale"] = hf.get("embedding_multiplier") or 1.0


HOOKS = FamilyHooks(hf_fields=hf_fields, hf_qk_permuted=True)
