"""Llama family: Mixtral (routed experts, top-k renormalised) and dense Llama / Mistral.

GGUF Q/K rows are permuted by the converter, so RoPE rotates adjacent pairs (llama.cpp NORM).
"""

from __future__ import annotations

from typing import Any

from moeswap.formats.config import ModelConfig
from moeswap.models.blocks import Attention
from moeswap.models.causal_lm import (CausalLM, PreNormLayer, assemble, attention_spec,
                                      attention_weights, dense_ffn, rope, router)
from moeswap.models.moe import DecisionRecorder, ExpertRunner, MoEBlock


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    rotary = rope(config, weights)
    layers = []
    for i in range(config.n_layer):
        attention = Attention(i, attention_weights(weights, i), attention_spec(config, i), rotary)
        ffn = (MoEBlock(i, router(config, weights, i), experts, recorder=recorder) if config.is_moe
               else dense_ffn(weights, i))
        layers.append(PreNormLayer(weights.tensor(f"blk.{i}.attn_norm.weight"), attention,
                                   weights.tensor(f"blk.{i}.ffn_norm.weight"), ffn, config.rms_eps))
    return assemble(config, source, weights, layers, recorder)
