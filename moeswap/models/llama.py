"""Llama family: Mixtral (routed experts, top-k renormalised) and dense Llama / Mistral.

GGUF Q/K rows are permuted by the converter, so RoPE rotates adjacent pairs (llama.cpp NORM).
"""

from __future__ import annotations

from typing import Any

from moeswap.formats.config import ModelConfig
from moeswap.models.causal_lm import CausalLM, build_pre_norm
from moeswap.models.moe import DecisionRecorder, ExpertRunner


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    return build_pre_norm(config, source, weights, experts, recorder)
