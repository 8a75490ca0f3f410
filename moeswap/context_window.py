"""What to do when a conversation outgrows its context (``--ctx``): refuse, or keep the start
and the most recent tokens.

A prompt must leave room for at least one generated token. With the ``keep-recent`` policy a
prompt that leaves less room than the reply asks for (``max_tokens``, at most half the
context) keeps its first ``keep_prefix`` tokens (BOS and the system prompt) and as many of
its most recent tokens as fit; the tokens in between are dropped.
"""

from __future__ import annotations

from typing import Sequence

from moeswap.errors import MoeswapError

POLICIES = ("error", "keep-recent")


class ContextOverflow(MoeswapError):
    """The prompt does not fit in the context and the policy does not allow cutting it."""


def fit_context(ids: Sequence[int], ctx: int, *, max_tokens: int, policy: str,
                keep_prefix: int = 0) -> list[int]:
    """``ids`` as they can be sent to a model whose context holds ``ctx`` positions."""
    ids = list(ids)
    if policy == "error":
        if len(ids) >= ctx:
            raise ContextOverflow(
                f"the prompt is {len(ids)} tokens but the context holds {ctx} (--ctx), with "
                "room for at least one new token; shorten it, raise --ctx, or use "
                "--ctx-policy keep-recent")
        return ids
    if policy != "keep-recent":
        raise MoeswapError(f"unknown context policy {policy!r}; known: {', '.join(POLICIES)}")
    room = max(1, min(max_tokens, ctx // 2))
    limit = ctx - room
    if len(ids) <= limit:
        return ids
    if keep_prefix >= limit:
        raise ContextOverflow(
            f"the kept start of the prompt (system prompt) is {keep_prefix} tokens, which leaves "
            f"no room in a context of {ctx} (--ctx) for recent tokens and a {room}-token reply; "
            "shorten the system prompt or raise --ctx")
    return ids[:keep_prefix] + ids[len(ids) - (limit - keep_prefix):]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
