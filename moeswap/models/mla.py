"""Multi-head latent attention (DeepSeek-V2), computed as llama.cpp does: absorbed into MQA.

Each token caches one latent: the RMS-normed compressed KV (kv_lora_rank wide) and one
rotated key part shared by all heads. Queries are projected into the latent space through
k_b, attend over the latents as one shared KV head, and the result leaves through v_b. This
equals decompressing per-head keys and values (transformers' form) and caches H*(P+R+V)/(L+R)
times fewer numbers.

Legend: N tokens of the batch, T tokens of one sequence, S cached positions, D model width,
H heads, P non-rotated query/key dims per head, R rotated dims, L kv_lora_rank, V value dims
per head, Q q_lora_rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeswap.formats.config import ModelConfig
from moeswap.models.blocks import AttentionSpec, Batch, Linear, Rope, attend, rms_norm
from moeswap.models.linear import QuantHeads, TorchHeads


@dataclass
class MLAWeights:
    wkv_a: Linear  # [N, D] -> [N, L+R]
    kv_a_norm: torch.Tensor  # [L]
    wk_b: TorchHeads | QuantHeads  # [N, H, P] -> [N, H, L]
    wv_b: TorchHeads | QuantHeads  # [N, H, L] -> [N, H, V]
    wo: Linear  # [N, H*V] -> [N, D]
    wq: Linear | None = None  # [N, D] -> [N, H*(P+R)] when there is no query compression
    wq_a: Linear | None = None  # [N, D] -> [N, Q]
    q_a_norm: torch.Tensor | None = None  # [Q]
    wq_b: Linear | None = None  # [N, Q] -> [N, H*(P+R)]

    @classmethod
    def from_weights(cls, weights: Any, layer: int) -> "MLAWeights":
        p = f"blk.{layer}."
        if weights.has(p + "attn_q.weight"):
            query = dict(wq=weights.linear(p + "attn_q.weight"))
        else:
            query = dict(wq_a=weights.linear(p + "attn_q_a.weight"),
                         q_a_norm=weights.tensor(p + "attn_q_a_norm.weight"),
                         wq_b=weights.linear(p + "attn_q_b.weight"))
        return cls(weights.linear(p + "attn_kv_a_mqa.weight"), weights.tensor(p + "attn_kv_a_norm.weight"),
                   weights.heads(p + "attn_k_b.weight"), weights.heads(p + "attn_v_b.weight"),
                   weights.linear(p + "attn_output.weight"), **query)


class MLAttention:
    def __init__(self, layer: int, weights: MLAWeights, config: ModelConfig, rope: Rope):
        c = config
        self.layer, self.w, self.rope, self.eps = layer, weights, rope, c.rms_eps
        self.n_head, self.n_rot, self.rank = c.n_head, c.n_rot, c.kv_lora_rank
        self.n_nope = c.head_dim_k_mla - c.n_rot
        # One shared KV head over latent + rotated part; scale from the decompressed head size.
        self.spec = AttentionSpec(c.n_head, 1, c.kv_lora_rank + c.n_rot, c.attention_scale, c.rms_eps)

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        w = self.w
        if w.wq is not None:
            q = w.wq(x)  # [N, H*(P+R)]
        else:
            q = w.wq_b(rms_norm(w.wq_a(x), w.q_a_norm, self.eps))  # [N, H*(P+R)]
        q = q.view(x.shape[0], self.n_head, self.n_nope + self.n_rot)  # [N, H, P+R]
        q_nope, q_pe = q[..., :self.n_nope], q[..., self.n_nope:]  # [N, H, P], [N, H, R]
        kv = w.wkv_a(x)  # [N, L+R]
        latent = rms_norm(kv[:, :self.rank], w.kv_a_norm, self.eps)  # [N, L]
        k_pe = self.rope(kv[:, None, self.rank:], batch.positions)  # [N, 1, R]
        q_pe = self.rope(q_pe, batch.positions)
        q_latent = w.wk_b(q_nope)  # [N, H, L]
        queries = torch.cat((q_latent, q_pe), dim=-1)  # [N, H, L+R]
        keys_new = torch.cat((latent[:, None], k_pe), dim=-1)  # [N, 1, L+R]
        out = queries.new_empty(x.shape[0], self.n_head, self.rank)  # [N, H, L]
        for (start, end), cache in zip(batch.spans, batch.caches):
            new = keys_new[start:end]
            # keys [S, 1, L+R]; the values are the latents, so none are stored
            keys, _, k_pos = cache.append(self.layer, new, new[..., :0])
            out[start:end] = attend(self.spec, queries[start:end], keys, keys[..., :self.rank],
                                    cache.length, k_pos)
        heads = w.wv_b(out)  # [N, H, V]
        return w.wo(heads.flatten(1))  # [N, D]
