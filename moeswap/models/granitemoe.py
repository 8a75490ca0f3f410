"""Granite-MoE (and Granite-MoE-Shared): the llama layout with IBM's multipliers — embeddings
times embedding_scale, attention scores times attention_scale (instead of 1/sqrt(head size)),
both residual branches times residual_scale, logits divided by logit_scale — softmax top-k
renormalised, and an ungated shared expert when expert_shared_feed_forward_length > 0.
"""

from __future__ import annotations

from typing import Any

from moeswap.formats.config import ModelConfig
from moeswap.models.causal_lm import CausalLM, build_pre_norm
from moeswap.models.glm4moe import ungated_shared_expert
from moeswap.models.moe import DecisionRecorder, ExpertRunner


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    shared = ungated_shared_expert if config.n_ff_shexp else None
    return build_pre_norm(config, source, weights, experts, recorder, shared_expert=shared)
