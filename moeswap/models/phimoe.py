"""Phi-3.5-MoE (phimoe): pre-norm layers whose norms carry a bias, attention with Q/K/V/O
biases and NeoX LongRoPE, a MoE block of 16 experts top-2, an output head with a bias.

A GGUF computes as llama.cpp's phimoe graph does, a HF folder as transformers' Phimoe does
(``formats.families.phimoe`` says where the two differ): the norm (RMS plus bias, or
LayerNorm), the routing (renormalised softmax top-2, or sparsemixer) and LongRoPE's factors
and cos/sin multiplier, which the config carries.

Legend: N tokens, D model width.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from moeswap.formats.config import ModelConfig
from moeswap.models.blocks import Attention, Batch, Rope, rms_norm
from moeswap.models.causal_lm import (CausalLM, attention_spec, attention_weights, dense_ffn,
                                      router)
from moeswap.models.moe import DecisionRecorder, ExpertRunner, MoEBlock

# llama.cpp rounds its context up to a multiple of this (GGML_PAD(n_ctx, 256)) before it
# compares it with the LongRoPE switch point.
_LLAMA_CPP_CTX_PAD = 256


@dataclass
class BiasedNorm:
    weight: torch.Tensor  # [D]
    bias: torch.Tensor  # [D]
    eps: float
    layer_norm: bool  # LayerNorm (transformers), else RMS norm plus the bias (llama.cpp)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        if self.layer_norm:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return rms_norm(x, self.weight, self.eps) + self.bias


@dataclass
class BiasedNormLayer:
    """x + attn(norm x), then + moe(norm x), with norms that carry a bias."""

    attn_norm: BiasedNorm
    attention: Attention
    ffn_norm: BiasedNorm
    ffn: Any  # MoEBlock: x [N, D] -> [N, D]

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        h = x + self.attention(self.attn_norm(x), batch)
        return h + self.ffn(self.ffn_norm(h))


class LongRope:
    """LongRoPE as llama.cpp chooses it: the long factors when the context (per sequence,
    padded as llama.cpp pads it) exceeds the original one, else the short factors; chosen
    once for the context, not per position."""

    def __init__(self, short: Rope, long: Rope, orig_ctx: int):
        self.short, self.long, self.orig_ctx = short, long, orig_ctx
        self.current = short

    def choose(self, context: int) -> None:
        padded = -(-context // _LLAMA_CPP_CTX_PAD) * _LLAMA_CPP_CTX_PAD
        self.current = self.long if padded > self.orig_ctx else self.short

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.current(x, positions)


class PhimoeLM(CausalLM):
    """CausalLM with a biased output norm, whose RoPE follows the context it is given
    (``context``: what load_model's budget charged; 0: the training context, as llama.cpp's
    n_ctx = 0)."""

    def __init__(self, rope: LongRope, final: BiasedNorm, *args: Any):
        self.rope, self.final = rope, final
        super().__init__(*args)

    @property
    def context(self) -> int:
        return self._context

    @context.setter
    def context(self, tokens: int) -> None:
        self._context = tokens
        self.rope.choose(tokens or self.config.n_ctx_train)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.final(x)


def long_rope(config: ModelConfig, weights: Any) -> LongRope:
    """A GGUF's rope_factors_short / _long tensors, or a HF folder's short factors for both."""
    def rope(factors: torch.Tensor | None) -> Rope:
        return Rope(config.n_rot, config.rope_base, config.rope_scale, config.rope_neox, factors,
                    mscale=config.rope_mscale)

    if weights.has("rope_factors_short.weight"):  # one factor per rotated pair
        short = weights.vector("rope_factors_short.weight", config.n_rot // 2)
        long = weights.vector("rope_factors_long.weight", config.n_rot // 2)
    else:
        short = long = torch.tensor(config.rope_factors) if config.rope_factors else None
    return LongRope(rope(short), rope(long), config.rope_orig_ctx)


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> PhimoeLM:
    def norm(name: str) -> BiasedNorm:
        return BiasedNorm(weights.tensor(f"{name}.weight"),
                          weights.vector(f"{name}.bias", config.n_embd), config.rms_eps,
                          config.layer_norm)

    rotary = long_rope(config, weights)
    moe = set(config.moe_layers)
    layers = []
    for i in range(config.n_layer):
        # llama.cpp's Phi-3 graph scales Qcur before attention: an f16 cache rounds the scaled q
        spec = replace(attention_spec(config, i), scale_q=True)
        attention = Attention(i, attention_weights(weights, i), spec, rotary)
        ffn = (MoEBlock(i, router(config, weights, i), experts, recorder=recorder) if i in moe
               else dense_ffn(weights, i))
        layers.append(BiasedNormLayer(norm(f"blk.{i}.attn_norm"), attention,
                                      norm(f"blk.{i}.ffn_norm"), ffn))
    return PhimoeLM(rotary, norm("output_norm"), config, source,
                    weights.embedding("token_embd.weight"), layers,
                    weights.tensor("output_norm.weight"),
                    weights.linear("output.weight", "output.bias"), recorder)
