"""GLM-4.5 / 4.6 (glm4moe): attention with Q/K/V biases, per-head q/k norms when the file has
them and NeoX RoPE on the first n_rot dims of each head; the first ``n_layer_dense_lead``
layers with a dense SwiGLU FFN, the rest MoE: sigmoid scores, top-k chosen on the scores plus
the selection bias ``exp_probs_b`` (``moe.Router``, as DeepSeek-V3), renormalised when
``expert_weights_norm``, times ``expert_weights_scale``, plus one ungated shared expert. The FFN
norm is ``post_attention_norm``. MTP layers (from n_layer on) are not built.
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
        if i < config.n_layer_dense_lead:
            ffn: Any = dense_ffn(weights, i)
        else:
            ffn = MoEBlock(i, router(config, weights, i), experts,
                           SharedExpert(dense_ffn(weights, i, "_shexp")), recorder)
        layers.append(PreNormLayer(weights.tensor(f"blk.{i}.attn_norm.weight"), attention,
                                   weights.tensor(f"blk.{i}.post_attention_norm.weight"), ffn,
                                   config.rms_eps))
    return assemble(config, source, weights, layers, recorder)
