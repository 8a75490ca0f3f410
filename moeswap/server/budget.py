"""What a batch charges to the host budget (``--host-mem``) besides the experts.

The expert store charges its host tier with the shared weights, staging slots and a KV cache
of ``context_tokens`` positions (moeswap.experts.store). A server batch also needs each step's
working memory: per fed token its activations, attention scores over the context and logits
(the engine computes logits for every position). ``--step-tokens`` bounds the tokens of a step,
so this is bounded too; it is charged as the KV positions that take the same bytes, so the
store leaves that much of the budget free of experts.

Legend of the estimate (bytes per fed token, float32): V vocabulary, H query heads, C context
(--ctx), D model width; logits and their sampled copy 2V, scores and softmax 2HC, activations
about 16D (residual, norms, q/k/v/o, router, expert inputs and outputs).
"""

from __future__ import annotations

from moeswap.experts.options import kv_bytes_per_token
from moeswap.formats.config import ModelConfig
from moeswap.server.batching import BatchOptions


def step_working_bytes(config: ModelConfig, options: BatchOptions) -> int:
    per_token = 4 * (2 * config.n_vocab + 2 * config.n_head * options.ctx + 16 * config.n_embd)
    return options.step_tokens * per_token


def charged_positions(config: ModelConfig, options: BatchOptions) -> int:
    """KV positions to charge: every batch slot may fill its context, plus a step's working
    memory in positions' worth of bytes (rounded up)."""
    per_position = kv_bytes_per_token(config)
    return options.ctx * options.max_batch + -(-step_working_bytes(config, options) // per_position)
