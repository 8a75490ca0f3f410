"""Granite-MoE (and Granite-MoE-Shared): the llama layout with IBM's multipliers — embeddings
times embedding_scale, attention scores times attention_scale (instead of 1/sqrt(head size)),
both residual branches times residual_scale, logits divided by logit_scale — softmax top-k
renormalised, and an ungated shared expert when expert_shared_feed_forward_length > 0.
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
        shared = SharedExpert(dense_ffn(weights, i, "_shexp")) if config.n_ff_shexp else None
        moe = MoEBlock(i, router(config, weights, i), experts, shared, recorder=recorder)
        layers.append(PreNormLayer(weights.tensor(f"blk.{i}.attn_norm.weight"), attention,
                                   weights.tensor(f"blk.{i}.ffn_norm.weight"), moe, config.rms_eps,
                                   config.residual_scale))
    return assemble(config, source, weights, layers, recorder)
