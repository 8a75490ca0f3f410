"""What a batch charges to the host budget (``--host-mem``) besides the experts.

Each batch slot's cache may fill its context at once: every position on full-attention
layers, window - 1 + ``--step-tokens`` on sliding-window layers (a step feeds a sequence at
most that many tokens). A step's working memory is, per fed token, its activations, attention
scores over the context (--ctx) and logits; ``--step-tokens`` bounds it too. The sums are
moeswap.memory.HostCharge's, as for every other command.
"""

from __future__ import annotations

from moeswap.memory import HostCharge
from moeswap.server.batching import BatchOptions


def batch_charge(options: BatchOptions, kv_type: str = "f32") -> HostCharge:
    """The charge of every batch slot's context, fed --step-tokens tokens per step, its
    cache of ``kv_type`` (--kv-type)."""
    return HostCharge.for_batch(options.ctx, options.max_batch, options.step_tokens, kv_type)
