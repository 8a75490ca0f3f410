"""Tiny random transformers models of every family, built in-process (no download).

Shapes are chosen to exercise what each family does differently: GQA everywhere (except
OLMoE, whose llama.cpp loader wants a k-norm as wide as n_embd), Qwen2-MoE's gated shared
expert, Qwen3-MoE's explicit head size and per-head q/k norms, Granite's multipliers and
shared expert, Gemma 3's five local + one global layers with a 4-token window; DeepSeek-V2's
MLA with query compression, a leading dense layer, 2 shared experts, a routed scaling factor
and YaRN with DeepSeek's mscale, and its V2-Lite form (no query compression, which llama.cpp
recognises only at 26 or 27 layers; 24 of them dense to keep it fast); GPT-OSS's sinks, biases
everywhere, YaRN (truncated: the form llama.cpp computes) and alternating 4-token-window /
global layers; Gemma 4's MoE block beside the dense FFN, wider global heads with fewer kv heads
and keys as values, proportional RoPE on a quarter of each global head, also inside Gemma 4's
multimodal wrapper (tensors under model.language_model., as the 26B-A4B checkpoint is published).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256,
              tie_word_embeddings=False)


def _multimodal(wrapper_cls, text_cls):
    """A ...ForConditionalGeneration config around a text config, without vision or audio."""
    def make(**kwargs):
        return wrapper_cls(text_config=text_cls(**kwargs).to_dict(), vision_config=None,
                           audio_config=None)
    return make


def _configs():
    import transformers as tf

    moe = dict(num_experts_per_tok=2)
    deepseek2 = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96,
                     moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
                     n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=48,
                     kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                     routed_scaling_factor=2.5, topk_method="greedy",
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 64,
                                      "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale": 0.707, "mscale_all_dim": 0.707})
    # DeepSeek-V3's routing: sigmoid, a selection bias (drawn in build()), 8 experts in 4 groups
    # of which 2 are kept, top-3 renormalised; V3's YaRN (mscale = mscale_all_dim = 1).
    deepseek3 = dict({k: v for k, v in deepseek2.items() if k != "topk_method"},
                     n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                     scoring_func="sigmoid", topk_method="noaux_tc",
                     rope_parameters=dict(deepseek2["rope_parameters"], mscale=1.0, mscale_all_dim=1.0))
    # GLM-4.5's shape: DeepSeek-V3's routing without groups (drawn bias: build()), a leading
    # dense layer, half-rotary heads, Q/K/V biases and q/k norms (GLM-4.5 355B has them), one
    # MTP layer counted in the config and absent from the weights (a trunk-only folder).
    glm4moe = dict(COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=96,
                   moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
                   n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                   norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
                   num_nextn_predict_layers=1,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.5})
    # Llama 4's shape: 4 layers (layer 3 without RoPE), MoE every 2nd layer (1 and 3) beside a
    # wider dense FFN, 4 experts top-1 and a shared expert, Llama 3 RoPE scaling (as Scout) over
    # 64 original positions; 6-position chunks and a temperature floor of 4 so that both act
    # within a 16-token prompt. "llama4_scout": the same with Scout's 8192 / 8192 / 0.1, which
    # llama.cpp's GGUF hard-codes.
    llama4 = dict(COMMON, num_hidden_layers=4, head_dim=16, intermediate_size=32,
                  intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                  interleave_moe_layer_step=2, attention_chunk_size=6, floor_scale=4,
                  attn_scale=0.5, rope_parameters={
                      "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})
    gemma4 = dict(COMMON, num_hidden_layers=4, head_dim=16, global_head_dim=32,
                  num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=48,
                  enable_moe_block=True, num_experts=4, top_k_experts=2,
                  moe_intermediate_size=32, hidden_size_per_layer_input=0,
                  num_kv_shared_layers=0, sliding_window=4, final_logit_softcapping=30.0,
                  tie_word_embeddings=True,
                  layer_types=["sliding_attention", "full_attention"] * 2,
                  rope_parameters={"sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional",
                                                      "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1000000.0}})
    return {
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                    dict(COMMON, intermediate_size=64, num_local_experts=4, rope_theta=10000.0, **moe)),
        "qwen2moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                     dict(COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                          shared_expert_intermediate_size=48, **moe)),
        "qwen3moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                     dict(COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                          head_dim=32, norm_topk_prob=True, **moe)),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM,
                  dict(COMMON, num_key_value_heads=4, intermediate_size=32, num_experts=4, **moe)),
        "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM,
                       dict(COMMON, intermediate_size=32, num_local_experts=4, embedding_multiplier=3.0,
                            attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0, **moe)),
        "granitemoeshared": (tf.GraniteMoeSharedConfig, tf.GraniteMoeSharedForCausalLM,
                             dict(COMMON, intermediate_size=32, num_local_experts=4,
                                  shared_intermediate_size=48, embedding_multiplier=3.0,
                                  attention_multiplier=0.2, residual_multiplier=0.5,
                                  logits_scaling=2.0, **moe)),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                   dict(COMMON, num_hidden_layers=6, intermediate_size=96, head_dim=16,
                        query_pre_attn_scalar=16, sliding_window=4, tie_word_embeddings=True,
                        final_logit_softcapping=30.0,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default",
                                                               "rope_theta": 10000.0}})),
        "deepseek2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, deepseek2),
        "deepseek2_lite": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM,
                           dict(deepseek2, num_hidden_layers=26, first_k_dense_replace=24,
                                q_lora_rank=None)),
        "deepseek3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, deepseek3),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM,
                    dict(COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=32,
                         num_local_experts=4, sliding_window=4,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 64,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True},
                         **moe)),
        "gemma4": (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM, gemma4),
        "glm4moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, glm4moe),
        "llama4": (tf.Llama4TextConfig, tf.Llama4ForCausalLM, llama4),
        "llama4_scout": (tf.Llama4TextConfig, tf.Llama4ForCausalLM,
                         dict(llama4, attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1)),
        "gemma4_multimodal": (_multimodal(tf.Gemma4Config, tf.Gemma4TextConfig),
                              tf.Gemma4ForConditionalGeneration, gemma4),
    }


FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "olmoe", "granitemoe", "granitemoeshared", "gemma3",
            "deepseek2", "deepseek2_lite", "deepseek3", "gpt_oss", "gemma4", "gemma4_multimodal",
            "glm4moe")


def build(family: str, seed: int = 0, **overrides):
    """A float32 transformers model in eval mode, its weights drawn from `seed`."""
    config_cls, model_cls, kwargs = _configs()[family]
    torch.manual_seed(seed)
    config = config_cls(**{**kwargs, **overrides})
    model = model_cls(config).eval()
    if family == "gemma3":
        # Random norms around 0 would make Gemma's (1 + w) near 1 everywhere; spread them.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
    if family.startswith("gemma4"):
        # Norms, router scales, per-expert scales and layer scalars all start at 1; spread them.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                    p.normal_(1.0, 0.3)
            for name, b in model.named_buffers():
                if name.endswith("layer_scalar"):
                    b.uniform_(0.5, 1.5)
    if family in ("deepseek3", "glm4moe"):
        # The selection bias starts at zero; draw it as wide as the sigmoid scores' spread so
        # that it changes which experts are chosen (tests/test_deepseek3.py asserts it does).
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.2)
    if family == "glm4moe":
        # Attention biases start at zero and q/k norms at one; make both matter.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.normal_(0.0, 0.5)
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(1.0, 0.3)
    if family.startswith("llama4"):
        # Norms start at one; spread them so that each is seen where it belongs.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.3)
    if family == "gpt_oss":
        # Expert biases start at zero and sinks near it; make both matter. Larger expert
        # inputs make the SwiGLU clamps (|x| > 7) bite on some elements.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("_bias", "sinks", "router.bias")):
                    p.normal_(0.0, 1.0)
                elif name.endswith("gate_up_proj"):
                    p.normal_(0.0, 0.5)
    return model


_TEXT = ["The quick brown fox jumps over the lazy dog.",
         "Mixture of experts models route each token to a few experts.",
         "def add(a, b): return a + b", "Hello world, hello moeswap!",
         "Numbers 0 1 2 3 4 5 6 7 8 9 and more text here."] * 20


def save_tokenizer(folder: Path) -> None:
    """A SentencePiece BPE tokenizer.model of exactly VOCAB pieces, trained in-process."""
    import io

    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_TEXT), model_writer=proto,
                                   vocab_size=VOCAB, model_type="bpe", character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (Path(folder) / "tokenizer.model").write_bytes(proto.getvalue())


def save(family: str, folder: Path, seed: int = 0, **overrides):
    """Save the tiny model and a tokenizer as a HF folder; returns the transformers model."""
    model = build(family, seed, **overrides)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return model


def relative_error(out, ref) -> float:
    """Largest absolute difference over the reference's largest magnitude (tensors or arrays,
    compared in float64)."""
    out, ref = torch.as_tensor(out, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    return float((out - ref).abs().max() / ref.abs().max())


# (family, KV type) whose logits differ from llama.cpp's, and decode steps' from the whole
# forward's, in a few isolated rows on some CPUs (session 10's Intel Sapphire Rapids; none on
# session 9's AMD Zen 4): the rows before agree bit for bit, then single rows differ by 2e-3 to
# 1.8e-2 while their neighbours agree, the mark of an expert pick flipped at a near-tie of the
# tiny random router, not of drift (which would carry into every later row through the cache).
NEAR_TIES = {("glm4moe", "f32"), ("deepseek3", "f16")}


def assert_same_bits(out, reference, case: tuple[str, str]) -> None:
    """Logits [T, V] (numpy) equal the reference bit for bit; for a NEAR_TIES case, except at
    most 8 isolated rows after the first 16, within 0.05 and with the same greedy token."""
    if np.array_equal(out, reference):
        return
    assert case in NEAR_TIES, f"{case}: the logits are not the reference's bit for bit"
    differing = np.nonzero((out != reference).any(axis=1))[0]
    assert differing.min() >= 16 and len(differing) <= 8, differing
    assert np.abs(out - reference).max() < 0.05
    assert (out.argmax(axis=1) == reference.argmax(axis=1)).all()


def llama_cpp_scores(path, ids: torch.Tensor, kv_type: int = 0, n_ctx: int = 64):
    """llama.cpp's float32 logits [T, V] (numpy) for ids [T] on the GGUF at path, without flash
    attention (llama-cpp-python's default), its cache of GGML type kv_type (0 f32, 1 f16)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=64, logits_all=True, type_k=kv_type,
                          type_v=kv_type, flash_attn=False, n_threads=2, verbose=False)
    llm.eval(ids.tolist())
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def llama_cpp_quantized(source, path, ftype: int):
    """The GGUF at ``source`` quantized by llama.cpp's own quantizer to llama_ftype ``ftype``
    (15: Q4_K_M) at ``path`` -> path."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(),
                                          ctypes.byref(params)) == 0
    return path


def q4_k_m_mixtral(folder, **overrides):
    """The tiny Mixtral with 256-wide rows (K-quant blocks), quantized to Q4_K_M by llama.cpp
    in ``folder`` -> its path."""
    from moeswap.gguf_tools.convert import convert

    save("mixtral", folder / "hf", hidden_size=256, intermediate_size=256,
         initializer_range=0.02, **overrides)
    source = convert(folder / "hf", folder / "model.f32.gguf", "f32")
    q4_k_m = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    return llama_cpp_quantized(source, folder / "model.q4_k_m.gguf", q4_k_m)


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()
