"""Gemma 3 (dense): sandwich norms around attention and FFN, per-head q/k RMSNorm, GeGLU
(tanh GELU) FFN, embeddings times sqrt(n_embd), tied output. Local layers attend within a
sliding window with their own RoPE base; global layers use the main base and linear scaling.
Norm weights already include Gemma's +1 (the converter adds it; the HF loader does too).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from moeswap.formats.config import ModelConfig
from moeswap.models.blocks import Attention, Batch, DenseFFN, LayerGraph, Rope, rms_norm
from moeswap.models.causal_lm import CausalLM, assemble, attention_spec, attention_weights, dense_ffn
from moeswap.models.moe import DecisionRecorder


@dataclass
class SandwichLayer:
    attn_norm: torch.Tensor
    attention: Attention
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    ffn: DenseFFN
    post_ffn_norm: torch.Tensor
    eps: float
    graph: LayerGraph | None = None  # the same in ggml, up to or with the FFN (the loader's)

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.graph is not None:
            step = self.graph(x, batch)
            if step.out is not None:  # the FFN ran in the graph too
                return step.out
            h, ffn_input = step.h, step.ffn_input
        else:
            a = self.attention(rms_norm(x, self.attn_norm, self.eps), batch)
            h = x + rms_norm(a, self.post_attn_norm, self.eps)
            ffn_input = rms_norm(h, self.ffn_norm, self.eps)
        return h + rms_norm(self.ffn(ffn_input), self.post_ffn_norm, self.eps)


def build(config: ModelConfig, source: Any, weights: Any, experts: Any,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    c = config
    global_rope = Rope(c.n_rot, c.rope_base, c.rope_scale, neox=True)
    local_rope = Rope(c.n_rot, c.rope_base_swa, 1.0, neox=True)
    layers = []
    for i in range(c.n_layer):
        # llama.cpp scales Qcur before attention (kq_scale 1): an f16 cache rounds the scaled q
        spec = replace(attention_spec(c, i), scale_q=True)
        attention = Attention(i, attention_weights(weights, i), spec,
                              local_rope if c.swa_layers[i] else global_rope)
        p = f"blk.{i}."
        layers.append(SandwichLayer(
            weights.tensor(p + "attn_norm.weight"), attention,
            weights.tensor(p + "post_attention_norm.weight"), weights.tensor(p + "ffn_norm.weight"),
            dense_ffn(weights, i, gelu=True), weights.tensor(p + "post_ffw_norm.weight"), c.rms_eps))
    return assemble(config, source, weights, layers, recorder)
