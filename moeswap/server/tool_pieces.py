"""A reply's pieces with its tool calls parsed out, for a request whose calls are parsed.

A call can only be told from text once it is complete, so each choice's text is held until
the choice ends; then one piece carries its content (the text around the calls) and its
``tool_calls``, finish_reason "tool_calls" where it stopped by itself. Streamed, such a reply
comes as one content delta and one tool_calls delta at its end. A reply without calls comes
out as it would without tools.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from moeswap.server.choices import Choices, Piece
from moeswap.server.tool_calls import parse_tool_calls
from moeswap.tokenizer import Tokenizer


class ToolCallPieces:
    """``Choices``' interface (``pieces``, ``cancel``), calls parsed."""

    def __init__(self, choices: Choices, tokenizer: Tokenizer, convention: str):
        self.choices = choices
        self.tokenizer = tokenizer
        self.convention = convention

    def cancel(self) -> None:
        self.choices.cancel()

    async def pieces(self) -> AsyncIterator[Piece]:
        held: dict[int, list[Piece]] = {}
        async for piece in self.choices.pieces():
            parts = held.setdefault(piece.index, [])
            parts.append(piece)
            if piece.finish_reason is None:
                continue
            del held[piece.index]
            text = "".join(p.text for p in parts)
            tokens = tuple(e for p in parts for e in p.tokens)
            # special tokens spelled out: harmony's headers are made of them
            raw = self.tokenizer.decode(list(piece.ids), skip_special=False)
            content, calls = parse_tool_calls(raw, self.convention)
            if not calls:
                yield replace(piece, text=text, tokens=tokens)
                continue
            reason = "tool_calls" if piece.finish_reason == "stop" else piece.finish_reason
            yield replace(piece, text=content or "", tokens=tokens, tool_calls=tuple(calls),
                          finish_reason=reason)
