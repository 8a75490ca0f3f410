"""What a batch charges to the host budget (``--host-mem``) besides the experts.

The expert store charges its host tier with the shared weights, staging slots, the KV caches
of ``sequences`` sequences of ``context_tokens`` positions and a step's working memory
(moeswap.experts.store). Each batch slot's cache may fill its context: every position on
full-attention layers, window - 1 + ``--step-tokens`` on sliding-window layers (a step feeds a
sequence at most that many tokens; moeswap.experts.options.kv_cache_bytes). A step's working
memory is, per fed token, its activations, attention scores over the context and logits (the
engine computes logits for every position); ``--step-tokens`` bounds it too, and the store
leaves that much of the budget free of experts.

Legend of the estimate (bytes per fed token, float32): V vocabulary, H query heads, C context
(--ctx), D model width; logits and their sampled copy 2V, scores and softmax 2HC, activations
about 16D (residual, norms, q/k/v/o, router, expert inputs and outputs).
"""

from __future__ import annotations

from moeswap.experts.options import kv_cache_bytes
from moeswap.formats.config import ModelConfig
from moeswap.server.batching import BatchOptions


def step_working_bytes(config: ModelConfig, options: BatchOptions) -> int:
    per_token = 4 * (2 * config.n_vocab + 2 * config.n_head * options.ctx + 16 * config.n_embd)
    return options.step_tokens * per_token


def charged_bytes(config: ModelConfig, options: BatchOptions) -> int:
    """Host bytes a batch charges besides weights and staging: every batch slot's KV cache at
    a full context, plus one step's working memory (what the store's options below charge)."""
    return (kv_cache_bytes(config, options.ctx, options.max_batch, options.step_tokens)
            + step_working_bytes(config, options))


def store_kv_options(config: ModelConfig, options: BatchOptions) -> dict[str, int]:
    """The ExpertStore options (moeswap.experts.store.StoreOptions) that charge a batch."""
    return dict(context_tokens=options.ctx, sequences=options.max_batch,
                step_tokens=options.step_tokens, working_bytes=step_working_bytes(config, options))
