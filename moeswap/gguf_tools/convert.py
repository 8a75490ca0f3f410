"""HF folder -> GGUF, with llama.cpp's tensor names, shapes, types, metadata and layout.

Tensors come through ``SafetensorsWeights`` (the same name table and transforms the engine's
HF loader uses: Q/K permutation, per-expert stacking, Gemma's norm shift), so a converted
file and its HF folder give the engine identical weights. Type rules follow
convert_hf_to_gguf.py: 1-D tensors, ``*_norm.weight`` and the routers stay F32; everything else
takes the requested type, falling back to F16 when a row is not a whole number of blocks.
Tensors are planned from the shard headers, then computed and written one at a time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from moeswap.errors import MoeswapError
from moeswap.formats.config import ModelConfig, hf_rope_parameters, read_hf_config
from moeswap.formats.families.llama4 import HF_KEYS as LLAMA4_HF_KEYS
from moeswap.formats.families.llama4 import llama_cpp_reading
from moeswap.formats.families.phimoe import converter_long_rope
from moeswap.formats.safetensors_weights import SafetensorsWeights
from moeswap.formats.vocab_to_gguf import write_vocab
from moeswap.models.gemma4 import proportional_rope_factors

OUT_TYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}
_ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "_norm.weight")


def tensor_type(name: str, shape: list[int], out_type: str) -> gguf.GGMLQuantizationType:
    """The stored type llama.cpp's converter picks for a tensor of this name and torch shape."""
    if len(shape) <= 1 or name.endswith(_ALWAYS_F32) or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    qtype = OUT_TYPES[out_type][0]
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block_size:
        return gguf.GGMLQuantizationType.F16
    return qtype


def convert(folder: str | Path, out_path: str | Path, out_type: str = "f16",
            on_tensor: Callable[[str, int, int], None] | None = None) -> Path:
    """Write `folder`'s model to `out_path`. `on_tensor(name, index, total)` reports progress."""
    folder, out_path = Path(folder), Path(out_path)
    if out_type not in OUT_TYPES:
        raise MoeswapError(f"--type {out_type}: not supported (supported: {', '.join(OUT_TYPES)})")
    weights = SafetensorsWeights(folder)
    config = weights.config
    writer = gguf.GGUFWriter(out_path, config.arch)
    hf = read_hf_config(folder)
    _write_metadata(writer, config, hf, folder, out_type)
    n_tokens = write_vocab(writer, folder, config)

    # Tensors the reference converter computes from the config (generate_extra_tensors).
    extra = {}
    if config.arch == "gemma4":
        extra["rope_freqs.weight"] = proportional_rope_factors(config.head_dim, config.rope_partial)
    if config.arch in ("llama", "llama4") and config.rope_factors:  # Llama 3 scaling
        extra["rope_freqs.weight"] = torch.tensor(config.rope_factors, dtype=torch.float32)
    if config.arch == "phimoe" and (rope := converter_long_rope(hf, folder)).long:
        extra["rope_factors_long.weight"] = torch.tensor(rope.long, dtype=torch.float32)
        extra["rope_factors_short.weight"] = torch.tensor(rope.short, dtype=torch.float32)
    plan = []
    for name in [*extra, *weights.names()]:
        shape = list(extra[name].shape) if name in extra else weights.tensor_shape(name)
        if name == "token_embd.weight" and config.arch == "gemma3":
            shape[0] = min(shape[0], n_tokens)  # the reference drops rows past the tokenizer
        # MXFP4 experts (published GPT-OSS) stay MXFP4, as with llama.cpp's converter.
        qtype = (gguf.GGMLQuantizationType.MXFP4 if name not in extra and weights.is_mxfp4(name)
                 else tensor_type(name, shape, out_type))
        plan.append((name, shape, qtype))
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        # Element shape with a raw type: the writer stores it as is (torch order, reversed on disk).
        writer.add_tensor_info(name, tuple(shape), np.dtype(np.float32),
                               int(np.prod(shape)) // block_size * type_size, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, shape, qtype) in enumerate(plan):
        if name not in extra and qtype == gguf.GGMLQuantizationType.MXFP4:
            writer.write_tensor_data(weights.mxfp4_bytes(name).numpy())  # already ggml's bytes
        else:
            data = (extra[name] if name in extra else weights.tensor(name)).numpy()
            data = data[tuple(slice(0, n) for n in shape)]
            writer.write_tensor_data(gguf.quants.quantize(np.ascontiguousarray(data), qtype))
        if on_tensor is not None:
            on_tensor(name, index + 1, len(plan))
    writer.close()
    return out_path


def _quantized(qtype: gguf.GGMLQuantizationType) -> bool:
    return qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


def _write_metadata(writer: gguf.GGUFWriter, c: ModelConfig, hf: dict, folder: Path,
                    out_type: str) -> None:
    """The keys convert_hf_to_gguf.py writes for these architectures (TextModel + family)."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(folder.name)
    # GLM-4.5's MTP layers count in block_count (the reference's default; not written here).
    writer.add_block_count(c.n_layer + (hf.get("num_nextn_predict_layers") or 0
                                        if c.arch == "glm4moe" else 0))
    writer.add_context_length(c.n_ctx_train)
    writer.add_embedding_length(c.n_embd)
    if "intermediate_size" in hf:  # Llama 4's dense width is intermediate_size_mlp
        writer.add_feed_forward_length(c.n_ff if c.arch == "llama4" else hf["intermediate_size"])
    writer.add_head_count(c.n_head)
    if c.n_head_kv == c.n_head_kv_swa:  # else one value per layer (Gemma 4, below)
        writer.add_head_count_kv(c.n_head_kv)
    if c.rope_scale != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_scale)
    if c.yarn is not None:
        _write_yarn(writer, c, hf)
    writer.add_rope_freq_base(c.rope_base)
    if c.arch == "gemma3":
        writer.add_rope_freq_base_swa(c.rope_base_swa)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    if c.is_moe:
        writer.add_expert_count(c.n_expert)
        writer.add_expert_used_count(c.n_expert_used)
    if hf.get("head_dim") and c.arch not in ("granitemoe", "deepseek2", "gemma4"):
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    writer.add_file_type(OUT_TYPES[out_type][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)  # the reference writes it always
    if c.arch in ("llama", "granitemoe", "llama4"):
        writer.add_vocab_size(c.n_vocab)
        writer.add_rope_dimension_count(c.n_rot)
    if c.arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(c.n_ff_exp)
    if c.n_ff_shexp and c.arch not in ("deepseek2", "glm4moe", "llama4"):
        writer.add_expert_shared_feed_forward_length(c.n_ff_shexp)
    if c.arch == "deepseek2":
        _write_deepseek2(writer, c, hf)
    if c.arch == "gemma4":
        _write_gemma4(writer, c)
    if c.arch == "glm4moe":
        _write_glm4moe(writer, c, hf)
    if c.arch == "phimoe":
        _write_phimoe(writer, c, hf, folder)
    if c.arch == "llama4":
        _write_llama4(writer, c, folder)
    if c.arch == "gpt-oss":
        writer.add_sliding_window(c.sliding_window)
        writer.add_expert_feed_forward_length(c.n_ff_exp)
        if c.swa_layers != tuple(i % 2 == 0 for i in range(c.n_layer)):
            writer.add_sliding_window_pattern(list(c.swa_layers))
    if c.arch in ("qwen2moe", "qwen3moe", "olmoe") and c.expert_weights_norm != _LLAMA_CPP_NORM[c.arch]:
        # llama.cpp hard-codes renormalisation per architecture and ignores this key; say so.
        raise MoeswapError(f"{folder}/config.json: norm_topk_prob={c.expert_weights_norm} but "
                           f"llama.cpp always uses {_LLAMA_CPP_NORM[c.arch]} for {c.arch}; "
                           "the GGUF would run differently in llama.cpp")
    if c.arch == "granitemoe":
        for key, add in (("attention_multiplier", writer.add_attention_scale),
                         ("embedding_multiplier", writer.add_embedding_scale),
                         ("residual_multiplier", writer.add_residual_scale),
                         ("logits_scaling", writer.add_logit_scale)):
            if hf.get(key):
                add(hf[key])
    if c.arch == "gemma3":
        if abs(c.attention_scale * math.sqrt(c.head_dim) - 1.0) > 1e-6 and c.n_layer != 62:
            raise MoeswapError(f"{folder}/config.json: query_pre_attn_scalar differs from head_dim; "
                               "llama.cpp scales Gemma 3 queries by 1/sqrt(head_dim)")
        if c.final_logit_softcap:
            writer.add_final_logit_softcapping(c.final_logit_softcap)
        if c.sliding_window:
            writer.add_sliding_window(c.sliding_window)
        if c.swa_layers != _gemma3_default_pattern(c.n_layer):
            writer.add_sliding_window_pattern(list(c.swa_layers))


def _write_yarn(writer: gguf.GGUFWriter, c: ModelConfig, hf: dict) -> None:
    """TextModel.set_gguf_parameters' YaRN keys. llama.cpp reads type, factor and original
    context (and DeepSeek's log multiplier); it always truncates the correction dims, so a
    transformers config with truncate=false (GPT-OSS) runs slightly differently there."""
    params = hf_rope_parameters(hf, "full_attention")
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(c.yarn.factor)
    writer.add_rope_scaling_orig_ctx_len(c.yarn.orig_ctx)
    if params.get("beta_fast") is not None:
        writer.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
    if params.get("beta_slow") is not None:
        writer.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
    if c.arch == "deepseek2" and params.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])  # reference's 0.1x


def _write_deepseek2(writer: gguf.GGUFWriter, c: ModelConfig, hf: dict) -> None:
    """DeepseekV2Model.set_gguf_parameters: MLA sizes (the cache as MQA over the latent)."""
    writer.add_leading_dense_block_count(c.n_layer_dense_lead)
    writer.add_vocab_size(c.n_vocab)
    if c.q_lora_rank:
        writer.add_q_lora_rank(c.q_lora_rank)
    writer.add_kv_lora_rank(c.kv_lora_rank)
    writer.add_key_length(c.head_dim)  # kv_lora_rank + rope dims
    writer.add_value_length(c.kv_lora_rank)
    writer.add_key_length_mla(c.head_dim_k_mla)
    writer.add_value_length_mla(c.head_dim_v_mla)
    writer.add_expert_feed_forward_length(c.n_ff_exp)
    writer.add_expert_shared_count(c.n_expert_shared)
    if hf.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(c.expert_weights_scale)
    if c.expert_weights_norm:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(c.n_rot)
    # TextModel's routing keys, as the config spells them; a V3 folder without scoring_func
    # still computes sigmoid (transformers), so say so where llama.cpp would assume softmax.
    if hf.get("n_group") is not None:
        writer.add_expert_group_count(hf["n_group"])
    if hf.get("topk_group") is not None:
        writer.add_expert_group_used_count(hf["topk_group"])
    if hf.get("scoring_func") is not None or c.gating == "sigmoid":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if c.gating == "sigmoid"
                                      else gguf.ExpertGatingFuncType.SOFTMAX)


def _write_glm4moe(writer: gguf.GGUFWriter, c: ModelConfig, hf: dict) -> None:
    """Glm4MoeModel.set_gguf_parameters (MTP layers counted, their tensors not written: a
    "trunk-only" file, which llama.cpp loads)."""
    writer.add_expert_group_count(hf.get("n_group", 1))
    writer.add_expert_group_used_count(hf.get("topk_group", 1))
    writer.add_rope_dimension_count(c.n_rot)
    writer.add_expert_feed_forward_length(c.n_ff_exp)
    writer.add_expert_shared_count(c.n_expert_shared)
    writer.add_leading_dense_block_count(c.n_layer_dense_lead)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if hf.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(c.expert_weights_scale)
    if hf.get("norm_topk_prob") is not None:
        writer.add_expert_weights_norm(c.expert_weights_norm)
    if hf.get("num_nextn_predict_layers") is not None:
        writer.add_nextn_predict_layers(hf["num_nextn_predict_layers"])


def _write_phimoe(writer: gguf.GGUFWriter, c: ModelConfig, hf: dict, folder: Path) -> None:
    """PhiMoeModel.set_gguf_parameters: LongRoPE's original context and the converter's own
    attn_factor (families.phimoe.converter_long_rope)."""
    rope = converter_long_rope(hf, folder)
    writer.add_rope_scaling_orig_ctx_len(rope.orig_ctx)
    writer.add_rope_dimension_count(c.n_rot)
    writer.add_sliding_window(hf.get("sliding_window") or 0)
    if rope.attn_factor is not None:
        writer.add_rope_scaling_attn_factors(rope.attn_factor)


def _write_llama4(writer: gguf.GGUFWriter, c: ModelConfig, folder: Path) -> None:
    """Llama4Model.set_gguf_parameters; llama.cpp hard-codes the rest (families.llama4), so a
    folder whose chunks, temperature, NoPE layers or q/k norm differ is refused."""
    expected = llama_cpp_reading(c.n_layer, c.n_expert)
    differing = sorted({LLAMA4_HF_KEYS[name] for name, value in expected.items()
                        if getattr(c, name) != value})
    if differing:
        raise MoeswapError(f"{folder}/config.json: {', '.join(differing)}: not what "
                           "llama.cpp hard-codes for llama4 (attention_chunk_size 8192, floor_scale "
                           "8192, attn_scale 0.1, a NoPE layer every 4th, use_qk_norm unless 128 "
                           "experts); the GGUF would run differently in llama.cpp")
    writer.add_interleave_moe_layer_step(c.n_moe_layer_step)
    writer.add_expert_feed_forward_length(c.n_ff_exp)


def _write_gemma4(writer: gguf.GGUFWriter, c: ModelConfig) -> None:
    """Gemma4Model.set_gguf_parameters: sizes per layer type, proportional RoPE as rope_freqs."""
    writer.add_rope_freq_base_swa(c.rope_base_swa)
    if c.final_logit_softcap:
        writer.add_final_logit_softcapping(c.final_logit_softcap)
    writer.add_sliding_window(c.sliding_window)
    writer.add_shared_kv_layers(0)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_sliding_window_pattern(list(c.swa_layers))
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_key_length_swa(c.head_dim_swa)
    writer.add_value_length_swa(c.head_dim_swa)
    if c.is_moe:
        writer.add_expert_feed_forward_length(c.n_ff_exp)
    if c.n_head_kv != c.n_head_kv_swa:
        writer.add_head_count_kv([c.n_head_kv_swa if s else c.n_head_kv for s in c.swa_layers])
    writer.add_rope_dimension_count(c.n_rot)
    writer.add_rope_dimension_count_swa(c.n_rot_swa)


_LLAMA_CPP_NORM = {"qwen2moe": False, "qwen3moe": True, "olmoe": False}


def _gemma3_default_pattern(n_layer: int) -> tuple[bool, ...]:
    return tuple(i % 6 < 5 for i in range(n_layer))
