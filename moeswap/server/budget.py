"""What a batch charges to the host budget (``--host-mem``) besides the experts.

The expert store charges its host tier with the shared weights, staging slots, the KV caches
of ``sequences`` sequences of ``context_tokens`` positions and a step's working memory
(moeswap.experts.store). Each batch slot's cache may fill its context: every position on
full-attention layers, window - 1 + ``--step-tokens`` on sliding-window layers (a step feeds a
sequence at most that many tokens; moeswap.experts.options.kv_cache_bytes). A step's working
memory is, per fed token, its activations, attention scores over the context (--ctx) and
logits (moeswap.experts.options.forward_working_bytes); ``--step-tokens`` bounds it too, and
the store leaves that much of the budget free of experts.
"""

from __future__ import annotations

from moeswap.experts.options import forward_working_bytes, kv_cache_bytes
from moeswap.formats.config import ModelConfig
from moeswap.server.batching import BatchOptions


def step_working_bytes(config: ModelConfig, options: BatchOptions) -> int:
    """One step's working memory: --step-tokens fed tokens, at most the batch's contexts."""
    return forward_working_bytes(config, options.step_tokens, options.ctx, options.max_batch)


def charged_bytes(config: ModelConfig, options: BatchOptions) -> int:
    """Host bytes a batch charges besides weights and staging: every batch slot's KV cache at
    a full context, plus one step's working memory (what the store's options below charge)."""
    return (kv_cache_bytes(config, options.ctx, options.max_batch, options.step_tokens)
            + step_working_bytes(config, options))


def store_kv_options(config: ModelConfig, options: BatchOptions) -> dict[str, int]:
    """The ExpertStore options (moeswap.experts.store.StoreOptions) that charge a batch."""
    return dict(context_tokens=options.ctx, sequences=options.max_batch,
                step_tokens=options.step_tokens, working_bytes=step_working_bytes(config, options))
