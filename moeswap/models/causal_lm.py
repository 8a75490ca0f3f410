"""The decoder skeleton every family shares, and the helpers that fetch a layer's tensors.

``CausalLM.forward`` takes a batch of sequences at different positions, each with its own
KV cache, and returns each sequence's float32 logits; decoding token by token gives the same
logits as one full forward. Family modules build the layers; this module holds no family logic.

Legend: N tokens of the batch, T tokens of one sequence, D model width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable

import torch

from moeswap.formats.config import ModelConfig
from moeswap.models.blocks import (Attention, AttentionSpec, AttentionWeights, Batch, DenseFFN,
                                   KVCache, LayerGraph, Linear, Rope, rms_norm)
from moeswap.models.moe import DecisionRecorder, ExpertRunner, MoEBlock, Router, SharedExpert
from moeswap.quant.threads import torch_threads_for_step

Layer = Callable[[torch.Tensor, Batch], torch.Tensor]


@dataclass
class PreNormLayer:
    """x + attn(norm x), then + ffn(norm x); branches scaled by the residual multiplier (Granite)."""

    attn_norm: torch.Tensor
    attention: Attention
    ffn_norm: torch.Tensor
    ffn: Callable[[torch.Tensor], torch.Tensor]
    eps: float
    residual_scale: float = 1.0
    graph: LayerGraph | None = None  # the same in ggml, up to or with the FFN (the loader's)

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.graph is None:
            h = x + self.attention(rms_norm(x, self.attn_norm, self.eps), batch) * self.residual_scale
            return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps)) * self.residual_scale
        step = self.graph(x, batch)
        if step.out is not None:  # the FFN (dense or routed) ran in the graph too
            if step.ids is not None:
                self.ffn.report(None, step.ids, step.weights)
            return step.out
        f = (self.ffn(step.ffn_input) if step.ids is None
             else self.ffn.routed(step.ffn_input, step.ids, step.weights))
        return step.h + f * self.residual_scale


class CausalLM:
    def __init__(self, config: ModelConfig, source: Any,
                 embedding: Callable[[torch.Tensor], torch.Tensor], layers: list[Layer],
                 output_norm: torch.Tensor, output: Linear, recorder: DecisionRecorder | None = None):
        self.config = config
        self.source = source  # the GGUFFile or HF folder the weights come from
        self.embedding = embedding  # ids [N] -> [N, D]
        self.layers = layers
        self.output_norm = output_norm  # [D]
        self.output = output  # [N, D] -> [N, V]; over the embedding table when tied
        self.recorder = recorder  # told the batch layout; the MoE blocks hand it their decisions
        # What a host budget charged each sequence's cache for (load_model's context_tokens
        # and step_tokens; 0: no budget): new caches are sized to it.
        self.context, self.step_tokens = 0, 0
        self.kv_dtype = torch.float32  # of the cached keys and values (load_model's kv_type)
        # The final norm and head in ggml (moeswap.models.head_graph), and one sequence's short
        # step as one ggml graph (moeswap.models.token_graph): the loader's, for GGUF files
        self.head_graph: Any = None
        self.token_graph: Any = None
        self.weights_in_ram = False  # a GGUF's data copied out of the mapped file (the loader's)

    def new_cache(self) -> KVCache:
        """An empty cache whose sliding-window layers keep only what they can still see,
        its buffers sized to the charged context (moeswap.models.blocks.KVCache)."""
        return KVCache(self.config.layer_windows, self.context, self.step_tokens, self.kv_dtype)

    @torch.inference_mode()
    def forward(self, tokens: list[torch.Tensor], caches: list[KVCache],
                last_only: bool = False) -> list[torch.Tensor]:
        """Per sequence: new token ids [T_i] -> float32 logits [T_i, V]; advances each cache.
        ``last_only``: the output head runs on each sequence's last position alone -> [1, V]
        each, what generation samples from (llama.cpp too computes only those rows): a prompt
        chunk of T tokens then holds no [T, V] logits and skips T - 1 rows of the head."""
        if len(tokens) != len(caches):
            raise ValueError(f"{len(tokens)} sequences but {len(caches)} caches")
        c = self.config
        lengths = [int(t.numel()) for t in tokens]
        if last_only and 0 in lengths:
            raise ValueError("last_only needs at least one new token in every sequence")
        ends = list(accumulate(lengths))
        spans = [(end - n, end) for end, n in zip(ends, lengths)]
        ids = (tokens[0].reshape(-1) if len(tokens) == 1
               else torch.cat([t.reshape(-1) for t in tokens]))  # [N]
        if self.recorder is not None:
            self.recorder.begin_forward(spans, [cache.length for cache in caches], caches)
        rooms = self.token_graph.rooms(lengths, caches) if self.token_graph is not None else None
        if rooms is not None:
            logits = self.token_graph(ids, caches, spans, rooms, last_only)  # [N or B, V]
        else:
            positions = torch.cat([torch.arange(cache.length, cache.length + n)
                                   for cache, n in zip(caches, lengths)])  # [N]
            batch = Batch(positions, spans, caches)
            x = self.embedding(ids)  # [N, D]
            if c.embedding_scale != 1.0:
                x = x * c.embedding_scale
            with torch_threads_for_step(len(positions)):  # decode: ggml's threads own the cores
                for layer in self.layers:
                    x = layer(x, batch)
            if last_only:
                x = x[[end - 1 for end in ends]]  # [B, D]: each sequence's last position
            logits = (self.head_graph(x) if self.head_graph is not None
                      else self.output(self.final_norm(x)))  # [N or B, V]
        if c.logit_scale != 1.0:
            logits = logits / c.logit_scale
        if c.final_logit_softcap:
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        for cache, n in zip(caches, lengths):
            cache.advance(n)
        rows = [(i, i + 1) for i in range(len(spans))] if last_only else spans
        return [logits[start:end].float() for start, end in rows]

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D] before the output head (a family with another norm overrides it)."""
        return rms_norm(x, self.output_norm, self.config.rms_eps)


def attention_weights(weights: Any, layer: int) -> AttentionWeights:
    """Q/K/V/O of a layer, with whichever biases and q/k norms the file has."""
    def optional(name: str) -> torch.Tensor | None:
        full = f"blk.{layer}.{name}"
        return weights.tensor(full) if weights.has(full) else None

    p = f"blk.{layer}."
    return AttentionWeights(
        wq=weights.linear(p + "attn_q.weight", p + "attn_q.bias"),
        wk=weights.linear(p + "attn_k.weight", p + "attn_k.bias"),
        wv=weights.linear(p + "attn_v.weight", p + "attn_v.bias"),
        wo=weights.linear(p + "attn_output.weight", p + "attn_output.bias"),
        q_norm=optional("attn_q_norm.weight"), k_norm=optional("attn_k_norm.weight"),
        sinks=optional("attn_sinks.weight"))


def attention_spec(config: ModelConfig, layer: int) -> AttentionSpec:
    c = config
    return AttentionSpec(c.n_head, c.n_head_kv, c.head_dim, c.attention_scale, c.rms_eps,
                         window=c.layer_windows[layer], chunked=c.chunked_attention,
                         softcap=c.attn_logit_softcap)


def rope(config: ModelConfig, weights: Any) -> Rope:
    """The model's RoPE; ``rope_freqs`` (Llama 3 scaling) divides the frequencies when present,
    as a folder's ``rope_factors`` do."""
    factors = weights.tensor("rope_freqs.weight") if weights.has("rope_freqs.weight") else None
    if factors is None and config.rope_factors:
        factors = torch.tensor(config.rope_factors)  # [R/2]
    return Rope(config.n_rot, config.rope_base, config.rope_scale, config.rope_neox, factors,
                config.yarn)


def router(config: ModelConfig, weights: Any, layer: int) -> Router:
    """The layer's router, with the logit bias (GPT-OSS) and selection bias (DeepSeek-V3's
    exp_probs_b) when the file has them."""
    def optional(name: str) -> torch.Tensor | None:
        return weights.tensor(name) if weights.has(name) else None

    return Router(weights.tensor(f"blk.{layer}.ffn_gate_inp.weight"), config.n_expert_used,
                  bool(config.expert_weights_norm), config.expert_weights_scale,
                  optional(f"blk.{layer}.ffn_gate_inp.bias"), config.gating,
                  optional(f"blk.{layer}.exp_probs_b.bias"),
                  (config.n_expert_groups, config.n_expert_groups_used), config.router_jitter)


def dense_ffn(weights: Any, layer: int, suffix: str = "", gelu: bool = False) -> DenseFFN:
    """ffn_{gate,up,down}{suffix}: the dense FFN ("") or the shared expert ("_shexp")."""
    p = f"blk.{layer}.ffn_"
    return DenseFFN(weights.linear(f"{p}gate{suffix}.weight"), weights.linear(f"{p}up{suffix}.weight"),
                    weights.linear(f"{p}down{suffix}.weight"), gelu)


# Builds layer i's shared expert (or None) from the weights: (weights, i) -> SharedExpert | None.
SharedExpertFactory = Callable[[Any, int], SharedExpert | None]
# Builds layer i's attention: Attention's own arguments (layer, weights, spec, rope).
AttentionFactory = Callable[[int, AttentionWeights, AttentionSpec, Rope], Attention]


def build_pre_norm(config: ModelConfig, source: Any, weights: Any, experts: ExpertRunner,
                   recorder: DecisionRecorder | None = None, *, ffn_norm: str = "ffn_norm",
                   shared_expert: SharedExpertFactory | None = None,
                   attention: AttentionFactory = Attention,
                   weight_expert_input: bool = False) -> CausalLM:
    """The pre-norm decoder the llama-like families share: attention, then the MoE block (a dense
    FFN in the leading dense layers, in Llama 4's interleaved ones and in a model without
    experts). Families differ in the FFN norm's name, the shared expert, where positions enter
    attention (Llama 4) and whether routing weights an expert's input (Llama 4) or its output;
    everything else (biases, q/k norms, rope kind, multipliers) the config carries."""
    rotary = rope(config, weights)
    moe = set(config.moe_layers)
    layers = []
    for i in range(config.n_layer):
        layer_attention = attention(i, attention_weights(weights, i), attention_spec(config, i),
                                    rotary)
        if i in moe:
            shared = shared_expert(weights, i) if shared_expert else None
            ffn = MoEBlock(i, router(config, weights, i), experts, shared, recorder=recorder,
                           weight_input=weight_expert_input)
        else:
            ffn = dense_ffn(weights, i)
        layers.append(PreNormLayer(weights.tensor(f"blk.{i}.attn_norm.weight"), layer_attention,
                                   weights.tensor(f"blk.{i}.{ffn_norm}.weight"), ffn, config.rms_eps,
                                   config.residual_scale))
    return assemble(config, source, weights, layers, recorder)


def assemble(config: ModelConfig, source: Any, weights: Any, layers: list[Layer],
             recorder: DecisionRecorder | None = None) -> CausalLM:
    output = weights.linear("output.weight" if weights.has("output.weight") else "token_embd.weight")
    return CausalLM(config, source, weights.embedding("token_embd.weight"), layers,
                    weights.tensor("output_norm.weight"), output, recorder)
