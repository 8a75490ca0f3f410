"""A reply's pieces with its tool calls parsed out, for a request whose calls are parsed.

A call can only be told from text once it is complete, so it is held until the choice ends;
then the last piece carries the ``tool_calls`` (finish_reason "tool_calls" where the reply
stopped by itself). What comes before a call streams as usual where it can be told apart:
- Hermes, where ``<tool_call>`` decodes as text: text streams until that mark, holding back
  a tail that could begin it (and the whitespace before it); from the mark on it is held;
- harmony (its headers are special tokens, not text), or a ``<tool_call>`` that is a special
  token: the whole reply is held and parsed from its tokens, special ones spelled out.
A reply without calls comes out as it would without tools, only later where it was held.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from moeswap.server.choices import Choices, Piece
from moeswap.server.tool_calls import HERMES, ToolCall, parse_tool_calls
from moeswap.tokenizer import Tokenizer

MARK = "<tool_call>"


class ToolCallPieces:
    """``Choices``' interface (``pieces``, ``cancel``), calls parsed."""

    def __init__(self, choices: Choices, tokenizer: Tokenizer, convention: str):
        self.choices = choices
        self.tokenizer = tokenizer
        self.convention = convention
        ids = tokenizer.encode(MARK, add_special=False)
        self.mark_is_text = convention == HERMES and tokenizer.decode(ids) == MARK

    def cancel(self) -> None:
        self.choices.cancel()

    async def pieces(self) -> AsyncIterator[Piece]:
        replies: dict[int, _TextUntilMark | _Held] = {}
        async for piece in self.choices.pieces():
            reply = replies.get(piece.index)
            if reply is None:
                reply = replies[piece.index] = _TextUntilMark() if self.mark_is_text else _Held()
            text = reply.push(piece.text)
            if piece.finish_reason is None:
                if text or piece.tokens:
                    yield replace(piece, text=text)
                continue
            if isinstance(reply, _TextUntilMark):
                content, calls = reply.end()
            else:  # special tokens spelled out: harmony's headers are made of them
                raw = self.tokenizer.decode(list(piece.ids), skip_special=False)
                content, calls = parse_tool_calls(raw, self.convention)
                content = (content or "") if calls else reply.text
            yield _last(piece, text + content, calls)


def _last(piece: Piece, text: str, calls: list[ToolCall]) -> Piece:
    if not calls:
        return replace(piece, text=text)
    reason = "tool_calls" if piece.finish_reason == "stop" else piece.finish_reason
    return replace(piece, text=text, tool_calls=tuple(calls), finish_reason=reason)


class _Held:
    """The whole reply, held."""

    def __init__(self):
        self.text = ""

    def push(self, text: str) -> str:
        self.text += text
        return ""


class _TextUntilMark:
    """Text passes until the first ``<tool_call>``; the rest is held and parsed at the end."""

    def __init__(self):
        self.pending = ""  # text that may still run into the mark
        self.held: str | None = None  # from the mark on, once seen
        self.gap = ""  # whitespace before the mark: back into the text if no call parses

    def push(self, text: str) -> str:
        if self.held is not None:
            self.held += text
            return ""
        self.pending += text
        at = self.pending.find(MARK)
        if at >= 0:
            out = self.pending[:at].rstrip()
            self.gap, self.held, self.pending = self.pending[len(out):at], self.pending[at:], ""
            return out
        start = next((k for k in range(min(len(MARK) - 1, len(self.pending)), 0, -1)
                      if self.pending.endswith(MARK[:k])), 0)
        before = self.pending[:len(self.pending) - start]
        cut = len(before.rstrip())  # whitespace before a mark is not content
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def end(self) -> tuple[str, list[ToolCall]]:
        """(the text not yet sent, the calls)."""
        if self.held is None:
            return self.pending, []
        content, calls = parse_tool_calls(self.held, HERMES)
        return ((content or "") if calls else self.gap + self.held), calls
