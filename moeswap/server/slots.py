"""Prefix reuse: the ``--max-batch`` slots, each keeping the KV cache its last request left.

As llama-server's ``cache_prompt``: a finished request leaves its cache (the keys and values of
its prompt and reply) in its slot; a new request takes the free slot whose kept tokens share the
longest prefix with its prompt, else the least recently used one, and its cache is cut back to
that prefix so that only the rest of the prompt is fed. At least one token is always fed (the
sampler needs the last position's logits): a prompt cached whole re-feeds its last token.

A cache with sliding-window layers (Gemma 3/4, GPT-OSS) keeps a ring of its latest
window - 1 + ``--step-tokens`` positions per such layer (what the budget charges; without a
budget, window - 1 + its longest feed): it is cut back only while each ring still holds the
window - 1 positions before the prefix (``KVCache.can_truncate``); for a shorter prefix the cache
is dropped and the prompt prefilled from scratch.

Kept caches cost no more than the budget already charges: ``HostCharge`` counts ``--max-batch``
caches of ``--ctx`` positions, one per slot, whether a request is using it or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from moeswap.context_window import common_prefix_length


@dataclass
class Slot:
    ids: list[int] = field(default_factory=list)  # the tokens whose keys and values cache holds
    cache: Any = None
    used: int = 0  # when it was last handed out (a counter; 0: never)
    busy: bool = False


class Slots:
    def __init__(self, count: int, new_cache: Callable[[], Any]):
        self.slots = [Slot() for _ in range(count)]
        self.new_cache = new_cache
        self._clock = 0

    def take(self, prompt_ids: list[int]) -> tuple[Slot, Any, int]:
        """A free slot for this prompt -> (slot, its cache, prompt tokens already in it)."""
        free = [s for s in self.slots if not s.busy]  # the scheduler runs <= count requests
        shared = {id(s): common_prefix_length(s.ids, prompt_ids) for s in free}
        slot = max(free, key=lambda s: (shared[id(s)], -s.used))  # no prefix: least recent
        self._clock += 1
        slot.busy, slot.used = True, self._clock
        reused = min(shared[id(slot)], len(prompt_ids) - 1)  # feed at least one token
        if reused and not slot.cache.can_truncate(reused):
            reused = 0  # a ring that no longer holds what the prefix needs (module docstring)
        if reused:
            slot.cache.truncate(reused)
        else:
            slot.cache = None  # the old cache goes before the new one is made
            slot.cache = self.new_cache()
        slot.ids = []  # the request owns the cache until it gives it back
        return slot, slot.cache, reused

    def give_back(self, slot: Slot, ids: list[int], keep: bool) -> None:
        """The request has ended with ``ids`` in its cache; keep: the cache is whole (a failed
        step may have written some layers but not others)."""
        slot.busy = False
        slot.ids = list(ids) if keep else []
        if not keep:
            slot.cache = None
