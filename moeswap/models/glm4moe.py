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
from moeswap.models.causal_lm import CausalLM, build_pre_norm, dense_ffn
from moeswap.models.moe import DecisionRecorder, ExpertRunner, SharedExpert


def ungated_shared_expert(weights: Any, layer: int) -> SharedExpert:
    """The shared expert of ``layer``, without a gate (GLM-4.5, Granite-MoE-Shared, Llama 4)."""
    return SharedExpert(dense_ffn(weights, layer, "_shexp"))


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    return build_pre_norm(config, source, weights, experts, recorder,
                          ffn_norm="post_attention_norm", shared_expert=ungated_shared_expert)
