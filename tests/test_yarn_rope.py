"""YaRN RoPE against transformers' own _compute_yarn_parameters, for the published settings of
GPT-OSS (truncate=false, which llama.cpp cannot express) and DeepSeek-V2-Lite (mscale ratio)."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moeswap.formats.config import yarn_from_hf
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
