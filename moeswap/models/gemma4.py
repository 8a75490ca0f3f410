"""Gemma 4 (the 26B-A4B MoE and 31B dense layouts), after llama.cpp's src/models/gemma4.cpp.

Sandwich norms as in Gemma 3, but RMSNorm weights are used as stored (no +1), attention is
unscaled (q/k are RMS-normed per head) and values are RMS-normed without a weight. Sliding
layers have their own head size, kv heads and RoPE base; global layers may reuse the key
projection as values (``attention_k_eq_v``: no attn_v tensor) and rotate only part of each
head ("proportional" RoPE, given to llama.cpp as frequency factors in rope_freqs).

The FFN of an MoE layer is a dense GeGLU FFN and a routed GeGLU MoE side by side, each with
its own norms, summed, then post-normed. The router sees rms_norm(h) * scale / sqrt(D) of the
layer's residual h; softmax, top-k, renormalised; each expert's output is multiplied by its
own scale (per_expert_scale, ffn_down_exps.scale), which belongs to the expert.

Legend: N tokens of the batch, D model width, H query heads, K kv heads, E head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moeswap.formats.config import ModelConfig
from moeswap.models.blocks import AttentionSpec, Batch, DenseFFN, Rope, attend, rms_norm
from moeswap.models.causal_lm import CausalLM, assemble, dense_ffn
from moeswap.models.moe import DecisionRecorder, ExpertRunner, Router

NO_ROTATION = 1e30  # llama.cpp's frequency factor for the dims proportional RoPE leaves alone


def proportional_rope_factors(head_dim: int, partial: float) -> torch.Tensor:
    """[E/2] factors: 1 for the rotated pairs, 1e30 (frequency ~0) for the rest."""
    n_rotated = int(head_dim * partial / 2)
    return torch.tensor([1.0] * n_rotated + [NO_ROTATION] * (head_dim // 2 - n_rotated))


class Gemma4Attention:
    def __init__(self, layer: int, weights: Any, spec: AttentionSpec, rope: Rope):
        p = f"blk.{layer}."
        self.layer, self.spec, self.rope = layer, spec, rope
        self.wq, self.wk = weights.linear(p + "attn_q.weight"), weights.linear(p + "attn_k.weight")
        self.wv = weights.linear(p + "attn_v.weight") if weights.has(p + "attn_v.weight") else None
        self.wo = weights.linear(p + "attn_output.weight")
        self.q_norm = weights.tensor(p + "attn_q_norm.weight")
        self.k_norm = weights.tensor(p + "attn_k_norm.weight")

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        s = self.spec
        q = self.wq(x).view(-1, s.n_head, s.head_dim)  # [N, H, E]
        k = self.wk(x).view(-1, s.n_head_kv, s.head_dim)  # [N, K, E]
        v = k if self.wv is None else self.wv(x).view(-1, s.n_head_kv, s.head_dim)
        q = self.rope(rms_norm(q, self.q_norm, s.eps), batch.positions)
        k = self.rope(rms_norm(k, self.k_norm, s.eps), batch.positions)
        v = rms_norm(v, 1.0, s.eps)  # weightless value norm
        out = torch.empty_like(q)
        for (start, end), cache in zip(batch.spans, batch.caches):
            keys, values, k_pos = cache.append(self.layer, k[start:end], v[start:end])  # [S, K, E]
            out[start:end] = attend(s, q[start:end], keys, values, cache.length, k_pos)
        return self.wo(out.flatten(1))  # [N, D]


@dataclass
class Gemma4MoE:
    """The routed half of an MoE layer's FFN (before its post-norm)."""

    layer: int
    router: Router
    router_scale: torch.Tensor  # [D]
    pre_norm: torch.Tensor  # [D] pre_ffw_norm_2
    experts: ExpertRunner
    eps: float
    recorder: DecisionRecorder | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, D] (the layer's residual) -> [N, D]."""
        route_in = rms_norm(h, 1.0, self.eps) * (1.0 / math.sqrt(h.shape[-1])) * self.router_scale
        ids, weights = self.router(route_in)
        if self.recorder is not None:
            self.router.report(self.recorder, self.layer, route_in, ids, weights)
        return self.experts.run(self.layer, rms_norm(h, self.pre_norm, self.eps), ids, weights)


@dataclass
class Gemma4Layer:
    norms: dict[str, torch.Tensor]  # GGUF norm name (without blk.i. and .weight) -> [D]
    attention: Gemma4Attention
    ffn: DenseFFN
    moe: Gemma4MoE | None
    out_scale: torch.Tensor | None  # [1] layer_output_scale
    eps: float
    # x -> h, or the layer's output, in ggml (moeswap.models.gemma4_graph): the loader's
    graph: Callable[[torch.Tensor, Batch], torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        n, eps = self.norms, self.eps
        if self.graph is not None and self.graph.whole:  # the FFN too (gemma4_graph)
            return self.graph(x, batch)
        if self.graph is not None:
            h = self.graph(x, batch)
        else:
            a = self.attention(rms_norm(x, n["attn_norm"], eps), batch)
            h = x + rms_norm(a, n["post_attention_norm"], eps)
        f = self.ffn(rms_norm(h, n["ffn_norm"], eps))
        if self.moe is not None:
            f = rms_norm(f, n["post_ffw_norm_1"], eps) + rms_norm(self.moe(h), n["post_ffw_norm_2"], eps)
        out = h + rms_norm(f, n["post_ffw_norm"], eps)
        return out * self.out_scale if self.out_scale is not None else out


def build(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
          recorder: DecisionRecorder | None = None) -> CausalLM:
    c = config
    factors = (weights.tensor("rope_freqs.weight") if weights.has("rope_freqs.weight")
               else proportional_rope_factors(c.head_dim, c.rope_partial))
    global_rope = Rope(c.n_rot, c.rope_base, c.rope_scale, neox=True, freq_factors=factors)
    local_rope = Rope(c.n_rot_swa, c.rope_base_swa, 1.0, neox=True)
    moe_layers = set(c.moe_layers)
    layers = []
    for i in range(c.n_layer):
        p = f"blk.{i}."
        sliding = c.swa_layers[i]
        spec = (AttentionSpec(c.n_head, c.n_head_kv_swa, c.head_dim_swa, 1.0, c.rms_eps,
                              c.layer_windows[i])
                if sliding else AttentionSpec(c.n_head, c.n_head_kv, c.head_dim, 1.0, c.rms_eps))
        attention = Gemma4Attention(i, weights, spec, local_rope if sliding else global_rope)
        norm_names = ["attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"]
        moe = None
        if i in moe_layers:
            norm_names += ["post_ffw_norm_1", "post_ffw_norm_2"]
            router = Router(weights.tensor(p + "ffn_gate_inp.weight"), c.n_expert_used, normalize=True)
            moe = Gemma4MoE(i, router, weights.tensor(p + "ffn_gate_inp.scale"),
                            weights.tensor(p + "pre_ffw_norm_2.weight"), experts, c.rms_eps, recorder)
        norms = {name: weights.tensor(f"{p}{name}.weight") for name in norm_names}
        out_scale = p + "layer_output_scale.weight"
        layers.append(Gemma4Layer(norms, attention, dense_ffn(weights, i, gelu=True), moe,
                                  weights.tensor(out_scale) if weights.has(out_scale) else None,
                                  c.rms_eps))
    return assemble(config, source, weights, layers, recorder)
