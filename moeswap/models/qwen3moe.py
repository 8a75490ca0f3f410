"""Qwen3-MoE and OLMoE: RMSNorm on q and k before RoPE (NeoX), softmax top-k, no shared expert.

The two differ only in facts the config carries: Qwen3-MoE norms q/k per head, renormalises
the top-k weights and has an explicit head size (head_dim * n_head may differ from n_embd);
OLMoE norms the whole q and k projections and does not renormalise.
"""

from __future__ import annotations

from typing import Any

from moeswap.formats.config import ModelConfig
from moeswap.models.causal_lm import CausalLM, build_pre_norm
from moeswap.models.moe import DecisionRecorder, ExpertRunner


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    return build_pre_norm(config, source, weights, experts, recorder)
