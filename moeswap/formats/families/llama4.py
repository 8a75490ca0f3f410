"""Llama 4 (GGUF arch llama4, text part): MoE layers interleaved with dense ones, a shared
expert, top-1 sigmoid routing that weights the expert's input, every 4th layer without RoPE
(full attention, with attention temperature tuning), the others chunked attention with q/k
RMS-normalised after RoPE.

A GGUF follows llama.cpp (llama_model_llama4::load_arch_hparams), which hard-codes what the
converter does not write: chunks of 8192 positions, a temperature floor of 8192 and scale 0.1
(Scout's and Maverick's values), NoPE every 4th layer, and q/k norms unless the model has 128
experts (Maverick). A HF folder follows transformers' config: attention_chunk_size,
floor_scale, attn_scale, attn_temperature_tuning, use_qk_norm, no_rope_layers, moe_layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from moeswap.errors import MoeswapError
from moeswap.formats.families.hooks import FamilyHooks

# llama.cpp's constants for llama4 files (src/models/llama4.cpp).
LLAMA_CPP_CHUNK = 8192
LLAMA_CPP_TEMP_FLOOR = 8192
LLAMA_CPP_TEMP_SCALE = 0.1
NO_ROPE_STEP = 4
MAVERICK_EXPERTS = 128  # llama.cpp turns the q/k norm off for this expert count


# The ModelConfig fields above, as transformers' Llama4TextConfig names them.
HF_KEYS = {"sliding_window": "attention_chunk_size", "chunked_attention": "attention_chunk_size",
           "swa_layers": "layer_types", "no_rope_layers": "no_rope_layers",
           "attn_temp_floor": "floor_scale", "attn_temp_scale": "attn_scale",
           "qk_l2_norm": "use_qk_norm"}


def llama_cpp_reading(n_layer: int, n_expert: int) -> dict[str, Any]:
    """The ModelConfig fields llama.cpp fixes for a llama4 file (its default 3:1 pattern)."""
    return dict(sliding_window=LLAMA_CPP_CHUNK, chunked_attention=True,
                swa_layers=tuple((i + 1) % NO_ROPE_STEP != 0 for i in range(n_layer)),
                no_rope_layers=tuple((i + 1) % NO_ROPE_STEP == 0 for i in range(n_layer)),
                attn_temp_floor=LLAMA_CPP_TEMP_FLOOR, attn_temp_scale=LLAMA_CPP_TEMP_SCALE,
                qk_l2_norm=n_expert != MAVERICK_EXPERTS)


def gguf_fields(path: Any, key: Callable[..., Any], fields: dict[str, Any]) -> None:
    if not fields["n_expert"]:
        raise MoeswapError(f"{path}: llama4.expert_count is 0; llama.cpp refuses a llama4 model "
                           "without experts, and so does moeswap")
    if fields["sliding_window"] == 0 and key("attention.sliding_window") is not None:
        raise MoeswapError(f"{path}: llama4.attention.sliding_window = 0 (every layer full "
                           "attention, MobileLLM-style) is not supported")
    n_layer = fields["n_layer"]
    step = int(key("interleave_moe_layer_step", 0) or 0)
    if step <= 0:
        raise MoeswapError(f"{path}: required key 'llama4.interleave_moe_layer_step' is missing "
                           "or 0 (1: every layer is MoE, as in Llama 4 Scout)")
    pattern = fields["swa_layers"]  # from attention.sliding_window_pattern, when present
    fields.update(llama_cpp_reading(n_layer, fields["n_expert"]), n_moe_layer_step=step,
                  rope_base_swa=float(key("rope.freq_base_swa", fields["rope_base"])),
                  n_ff_shexp=_first(fields["n_ff_exp"]))  # llama.cpp: as wide as an expert
    if pattern:
        fields["swa_layers"] = pattern


def _first(value: Any) -> int:
    """A per-layer array's first entry (one width per model is checked after the hook)."""
    return int(value[0] if isinstance(value, list) else value)


def hf_fields(hf: dict[str, Any], folder: Path, fields: dict[str, Any]) -> None:
    """transformers' Llama4TextConfig: intermediate_size is an expert's (and the shared
    expert's) width, intermediate_size_mlp the dense layers'."""
    n_layer = fields["n_layer"]
    step = hf.get("interleave_moe_layer_step") or 1
    moe_layers = hf.get("moe_layers")
    if moe_layers is not None and list(moe_layers) != list(range(step - 1, n_layer, step)):
        raise MoeswapError(f"{folder}/config.json: moe_layers {moe_layers} is not every "
                           f"{step}-th layer (interleave_moe_layer_step); only that pattern, "
                           "which llama.cpp's GGUF can express, is supported")
    no_rope = hf.get("no_rope_layers") or [
        int((i + 1) % hf.get("no_rope_layer_interval", NO_ROPE_STEP) != 0) for i in range(n_layer)]
    chunk = hf.get("attention_chunk_size") or 0
    layer_types = hf.get("layer_types") or [
        "chunked_attention" if rope and chunk else "full_attention" for rope in no_rope]
    tuning = hf.get("attn_temperature_tuning", True)
    fields.update(
        n_ff=hf.get("intermediate_size_mlp") or hf["intermediate_size"],
        n_ff_exp=hf["intermediate_size"], n_ff_shexp=hf["intermediate_size"],
        n_moe_layer_step=step, no_rope_layers=tuple(not rope for rope in no_rope),
        sliding_window=chunk, chunked_attention=True,
        swa_layers=tuple(t == "chunked_attention" for t in layer_types),
        attn_temp_floor=int(hf.get("floor_scale", LLAMA_CPP_TEMP_FLOOR)) if tuning else 0,
        attn_temp_scale=float(hf.get("attn_scale", LLAMA_CPP_TEMP_SCALE)) if tuning else 0.0,
        qk_l2_norm=bool(hf.get("use_qk_norm", True)))


HOOKS = FamilyHooks(gguf_fields=gguf_fields, hf_fields=hf_fields)
