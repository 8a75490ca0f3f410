"""YaRN RoPE against transformers' own _compute_yarn_parameters, for the published settings of
GPT-OSS (truncate=false, which llama.cpp cannot express) and DeepSeek-V2-Lite (mscale ratio)."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moeswap.formats.rope_scaling import yarn_from_hf
from moeswap.models.blocks import Rope

GPT_OSS = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
               original_max_position_embeddings=4096)
DEEPSEEK_V2_LITE = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0,
                        beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
                        original_max_position_embeddings=4096)


@pytest.mark.parametrize("params", [dict(GPT_OSS, truncate=False), dict(GPT_OSS, truncate=True),
                                    DEEPSEEK_V2_LITE, dict(DEEPSEEK_V2_LITE, mscale=1.0)])
def test_yarn_frequencies_and_mscale_match_transformers(params):
    config = GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=256,
                          max_position_embeddings=131072, rope_parameters=dict(params))
    expected_inv_freq, expected_mscale = ROPE_INIT_FUNCTIONS["yarn"](config)
    yarn = yarn_from_hf(params, {"max_position_embeddings": 131072})
    rope = Rope(64, params["rope_theta"], 1.0, neox=True, yarn=yarn)
    assert torch.allclose(rope.inv_freq.float(), expected_inv_freq, rtol=1e-6, atol=0)
    assert rope.mscale == pytest.approx(expected_mscale, rel=1e-6)


def test_truncation_changes_the_frequencies():
    """The case that makes a GPT-OSS GGUF (llama.cpp: always truncated) differ from its folder."""
    truncated, exact = (Rope(64, 150000.0, 1.0, neox=True,
                             yarn=yarn_from_hf(dict(GPT_OSS, truncate=t), {})) for t in (True, False))
    assert not torch.equal(truncated.inv_freq, exact.inv_freq)


def test_deepseek_v2_lite_config_json(tmp_path):
    """The published config.json (transformers-4 `rope_scaling` with "type"): MLA sizes, routing
    and YaRN as llama.cpp reads the converted file."""
    import json
    import math

    from moeswap.formats.config import config_from_hf

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "scoring_func": "softmax", "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096}}))
    c = config_from_hf(tmp_path)
    assert (c.arch, c.n_head_kv, c.head_dim, c.n_rot, c.q_lora_rank) == ("deepseek2", 1, 576, 64, 0)
    assert (c.n_layer_dense_lead, c.moe_layers[0], c.n_ff, c.n_ff_shexp) == (1, 1, 10944, 2816)
    assert c.yarn is not None and (c.yarn.factor, c.yarn.orig_ctx, c.yarn.mscale) == (40.0, 4096, 1.0)
    mscale = 0.1 * 0.707 * math.log(40) + 1
    assert c.attention_scale == pytest.approx(mscale * mscale / math.sqrt(192))
