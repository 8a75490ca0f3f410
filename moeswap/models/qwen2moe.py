"""Qwen2-MoE: softmax top-k without renormalisation, plus one shared expert on every token
gated by sigmoid(ffn_gate_inp_shexp . x); Q/K/V biases; NeoX RoPE.
"""

from __future__ import annotations

from typing import Any

from moeswap.formats.config import ModelConfig
from moeswap.models.causal_lm import CausalLM, build_pre_norm, dense_ffn
from moeswap.models.moe import DecisionRecorder, ExpertRunner, SharedExpert


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    def gated_shared_expert(weights: Any, layer: int) -> SharedExpert:
        """The shared expert, scaled per token by sigmoid(ffn_gate_inp_shexp . x); the gate is
        {n_embd} to llama.cpp, which llama.cpp's converter stores as [1, n_embd]."""
        return SharedExpert(dense_ffn(weights, layer, "_shexp"), gate=weights.vector(
            f"blk.{layer}.ffn_gate_inp_shexp.weight", config.n_embd))

    return build_pre_norm(config, source, weights, experts, recorder, shared_expert=gated_shared_expert)
