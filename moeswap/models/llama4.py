"""Llama 4 (text part): the pre-norm decoder with MoE layers interleaved with dense ones
(``n_moe_layer_step``), each MoE layer's top-k chosen on the router logits and weighted by their
sigmoid, the weight scaling the expert's input (llama.cpp's weight_before_ffn, transformers'
routed_in), plus an ungated shared expert. RoPE layers (adjacent pairs, as llama.cpp's NORM and
transformers' complex rotation) attend within aligned chunks and RMS-normalise q and k without a
weight after RoPE (``qk_l2_norm``); NoPE layers attend to every position with q scaled by the
attention temperature. Which constants a GGUF and a HF folder take: formats.families.llama4.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moeswap.formats.config import ModelConfig
from moeswap.models.blocks import Attention, AttentionSpec, AttentionWeights, Rope, rms_norm
from moeswap.models.causal_lm import CausalLM, build_pre_norm, rope
from moeswap.models.glm4moe import ungated_shared_expert
from moeswap.models.moe import DecisionRecorder, ExpertRunner


class Llama4Attention(Attention):
    def __init__(self, layer: int, weights: AttentionWeights, spec: AttentionSpec, rotary: Rope,
                 config: ModelConfig):
        super().__init__(layer, weights, spec, rotary)
        self.use_rope = not config.no_rope_layers[layer]
        self.qk_norm = config.qk_l2_norm
        self.temp_floor, self.temp_scale = config.attn_temp_floor, config.attn_temp_scale
        self.unit = torch.ones(())  # the L2 norm's weight

    def place(self, q: torch.Tensor, k: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, H, E], k [N, K, E] at positions [N] -> the same, rotated and normalised (RoPE
        layers) or q times log(floor((p + 1) / floor) + 1) * scale + 1 (NoPE layers)."""
        if self.use_rope:
            q, k = super().place(q, k, positions)
            if self.qk_norm:
                q, k = rms_norm(q, self.unit, self.spec.eps), rms_norm(k, self.unit, self.spec.eps)
            return q, k
        if self.temp_floor:
            steps = torch.floor((positions.to(torch.float32) + 1.0) / self.temp_floor)  # [N]
            scale = torch.log1p(steps) * self.temp_scale + 1.0  # [N]
            q = q * scale.to(q.dtype)[:, None, None]
        return q, k


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    chunk_rope = None  # the chunked (sliding) layers' own base, when the file gives one
    if config.rope_base_swa != config.rope_base:
        chunk_rope = rope(dataclasses.replace(config, rope_base=config.rope_base_swa), weights)

    def attention(layer: int, w: AttentionWeights, spec: AttentionSpec, rotary: Rope) -> Attention:
        if chunk_rope is not None and config.swa_layers[layer]:
            rotary = chunk_rope
        return Llama4Attention(layer, w, spec, rotary, config)

    return build_pre_norm(config, source, weights, experts, recorder,
                          shared_expert=ungated_shared_expert, attention=attention,
                          weight_expert_input=True)
