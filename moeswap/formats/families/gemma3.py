"""Gemma 3: scales llama.cpp hard-codes, sandwich norms, and the +1 on norm weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from moeswap.formats.families.hooks import FamilyHooks

# Norms around attention and FFN: HF per-layer name -> GGUF name (shared with Gemma 4).
SANDWICH_NORMS = {"post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_fields(path: Any, key: Callable[..., Any], fields: dict[str, Any]) -> None:
    # Hard-coded in llama.cpp's gemma3 graph: embeddings times sqrt(n_embd), and the
    # 27B model (62 layers) scales queries by n_embd / n_head instead of the head size.
    fields["embedding_scale"] = math.sqrt(fields["n_embd"])
    if fields["n_layer"] == 62:
        fields["attention_scale"] = 1.0 / math.sqrt(fields["n_embd"] // fields["n_head"])


def hf_fields(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    fields["attention_scale"] = hf.get("query_pre_attn_scalar", hf.get("head_dim", 256)) ** -0.5
    fields["embedding_scale"] = hf["hidden_size"] ** 0.5


HOOKS = FamilyHooks(gguf_fields=gguf_fields, hf_fields=hf_fields, hf_layer_types=True,
                    hf_layer_norms=SANDWICH_NORMS, hf_norm_plus_one=True)
