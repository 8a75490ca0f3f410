"""Qwen3-MoE and OLMoE: RMSNorm on q and k before RoPE (NeoX), softmax top-k, no shared expert.

The two differ only in facts the config carries: Qwen3-MoE norms q/k per head, renormalises
the top-k weights and has an explicit head size (head_dim * n_head may differ from n_embd);
OLMoE norms the whole q and k projections and does not renormalise.
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
                                   weights.tensor(f"blk.{i}.ffn_norm.weight"), moe, config.rms_eps))
    return assemble(config, source, weights, layers, recorder)
