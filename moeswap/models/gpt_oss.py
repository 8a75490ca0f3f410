"""GPT-OSS: GQA attention with Q/K/V/O biases and a learned sink logit per head; even layers
attend within a sliding window, odd layers globally (llama.cpp's pattern 2); NeoX RoPE. The FFN
(pre-normed by ``post_attention_norm``) is MoE only: router logits plus bias, top-k logits, softmax
over those k; experts are clamped SwiGLU (``experts.swiglu_oai``) with per-expert biases,
usually stored as MXFP4.
"""

from __future__ import annotations

from typing import Any

from moeswap.formats.config import ModelConfig
from moeswap.models.blocks import Attention
from moeswap.models.causal_lm import (CausalLM, PreNormLayer, assemble, attention_spec,
                                      attention_weights, rope, router)
from moeswap.models.moe import DecisionRecorder, ExpertRunner, MoEBlock


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    rotary = rope(config, weights)
    layers = []
    for i in range(config.n_layer):
        attention = Attention(i, attention_weights(weights, i), attention_spec(config, i), rotary)
        moe = MoEBlock(i, router(config, weights, i), experts, recorder=recorder)
        layers.append(PreNormLayer(weights.tensor(f"blk.{i}.attn_norm.weight"), attention,
                                   weights.tensor(f"blk.{i}.post_attention_norm.weight"), moe,
                                   config.rms_eps))
    return assemble(config, source, weights, layers, recorder)
