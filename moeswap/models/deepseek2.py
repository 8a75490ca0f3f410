"""DeepSeek-V2 / V2-Lite / V3 / R1, Kimi-K2: MLA attention (``mla``), the first
``n_layer_dense_lead`` layers with a dense SwiGLU FFN, the rest MoE: softmax (V2) or sigmoid
(V3) over the routed experts, top-k (V3: chosen on the scores plus the selection bias
``exp_probs_b``, within the best expert groups; ``moe.Router``), renormalised only when
``expert_weights_norm``, weights times ``expert_weights_scale`` (routed_scaling_factor), plus the
shared experts fused into one ungated SwiGLU ``n_expert_shared x n_ff_exp`` wide. RoPE rotates
adjacent pairs (llama.cpp NORM; the converter does not permute).
"""

from __future__ import annotations

from typing import Any

from moeswap.formats.config import ModelConfig
from moeswap.models.causal_lm import CausalLM, PreNormLayer, assemble, dense_ffn, rope, router
from moeswap.models.mla import MLAttention, MLAWeights
from moeswap.models.moe import DecisionRecorder, ExpertRunner, MoEBlock, SharedExpert


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    rotary = rope(config, weights)
    layers = []
    for i in range(config.n_layer):
        attention = MLAttention(i, MLAWeights.from_weights(weights, i), config, rotary)
        if i < config.n_layer_dense_lead:
            ffn: Any = dense_ffn(weights, i)
        else:
            ffn = MoEBlock(i, router(config, weights, i), experts,
                           SharedExpert(dense_ffn(weights, i, "_shexp")), recorder)
        layers.append(PreNormLayer(weights.tensor(f"blk.{i}.attn_norm.weight"), attention,
                                   weights.tensor(f"blk.{i}.ffn_norm.weight"), ffn, config.rms_eps))
    return assemble(config, source, weights, layers, recorder)
