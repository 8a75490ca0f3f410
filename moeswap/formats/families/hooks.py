"""FamilyHooks: what one architecture adds to the reading every family shares.

``formats.config`` reads the keys all families use into a dict of ``ModelConfig`` fields and
hands it to the family's hook, which checks that moeswap computes this variant and changes the
fields llama.cpp or transformers give a meaning of their own. ``formats.hf_names`` asks the
family how its HF tensors differ from the shared name table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

# (path, key, fields): key(name, default) reads "<arch>.<name>" (arrays as lists); per-layer
# values are still lists, checked for one width per model after the hook.
GgufHook = Callable[[Any, Callable[..., Any], dict[str, Any]], None]
# (hf, folder, fields): hf is config.json with a multimodal wrapper's text_config merged in.
HfHook = Callable[[dict[str, Any], Path, dict[str, Any]], None]


# The tensors every layer needs, as groups of alternatives (blk.N.<base>.weight): a norm,
# attention in one of llama.cpp's layouts (separate, fused QKV, MLA), an FFN (dense or experts).
LAYER_TENSORS: tuple[tuple[str, ...], ...] = (
    ("attn_norm",), ("attn_q", "attn_q_a", "attn_qkv"), ("attn_k", "attn_kv_a_mqa", "attn_qkv"),
    ("attn_v", "attn_kv_a_mqa", "attn_qkv"), ("attn_output",), ("ffn_down", "ffn_down_exps"))


def _no_change(*_: Any) -> None:
    """The family reads what every family reads."""


@dataclass(frozen=True)
class FamilyHooks:
    gguf_fields: GgufHook = _no_change
    hf_fields: HfHook = _no_change
    # The HF sliding_window applies whenever it is set and layer_types says which layers slide;
    # otherwise it needs use_sliding_window and covers every layer (Qwen, Mistral).
    hf_layer_types: bool = False
    # HF per-layer norm -> GGUF norm where the family's names differ from the shared table's.
    hf_layer_norms: Mapping[str, str] = field(default_factory=dict)
    hf_qk_permuted: bool = False  # the converter permutes Q/K rows: GGUF RoPE is not NeoX
    hf_norm_plus_one: bool = False  # the converter adds 1 to every norm weight
    # What formats.model_checks requires of every layer of a GGUF file (LAYER_TENSORS' form).
    gguf_layer_tensors: tuple[tuple[str, ...], ...] = LAYER_TENSORS
