"""GPT-OSS: GQA attention with Q/K/V/O biases and a learned sink logit per head; even layers
attend within a sliding window, odd layers globally (llama.cpp's pattern 2); NeoX RoPE. The FFN
(pre-normed by ``post_attention_norm``) is MoE only: router logits plus bias, top-k logits, softmax
over those k; experts are clamped SwiGLU (``experts.swiglu_oai``) with per-expert biases,
usually stored as MXFP4.
"""

from __future__ import annotations

from typing import Any

from moeswap.formats.config import ModelConfig
from moeswap.models.causal_lm import CausalLM, build_pre_norm
from moeswap.models.moe import DecisionRecorder, ExpertRunner


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    return build_pre_norm(config, source, weights, experts, recorder,
                          ffn_norm="post_attention_norm")
