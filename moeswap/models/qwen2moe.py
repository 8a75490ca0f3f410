"""Qwen2-MoE: softmax top-k without renormalisation, plus one shared expert on every token
gated by sigmoid(ffn_gate_inp_shexp . x); Q/K/V biases; NeoX RoPE.
"""

from __future__ import annotations

from typing import Any

from moeswap.formats.config import ModelConfig
from moeswap.models.blocks import Attention
from moeswap.models.causal_lm import (CausalLM, PreNormLayer, assemble, attention_spec,
                                      attention_weights, dense_ffn, rope, router)
from moeswap.models.moe import DecisionRecorder, ExpertRunner, MoEBlock, SharedExpert


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    rotary = rope(config, weights)
    layers = []
    for i in range(config.n_layer):
        attention = Attention(i, attention_weights(weights, i), attention_spec(config, i), rotary)
        shared = SharedExpert(dense_ffn(weights, i, "_shexp"),
                              gate=weights.tensor(f"blk.{i}.ffn_gate_inp_shexp.weight"))
        moe = MoEBlock(i, router(config, weights, i), experts, shared, recorder=recorder)
        layers.append(PreNormLayer(weights.tensor(f"blk.{i}.attn_norm.weight"), attention,
                                   weights.tensor(f"blk.{i}.ffn_norm.weight"), moe, config.rms_eps))
    return assemble(config, source, weights, layers, recorder)
