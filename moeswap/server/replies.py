"""The OpenAI response objects of one call (``Reply``): the whole reply, or its SSE chunks
ending in ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from moeswap.server.api_errors import ApiError, error_body
from moeswap.server.choices import Choices, GenerationFailed, Piece
from moeswap.tokenizer import Tokenizer


class Reply:
    """Builds the OpenAI response objects of one call."""

    def __init__(self, kind: str, id: str, model: str, prompt_tokens: int,
                 tokenizer: Tokenizer | None = None):
        """tokenizer: spells the tokens of logprobs (None: the call asked for none)."""
        self.kind, self.id, self.model, self.prompt_tokens = kind, id, model, prompt_tokens
        self.tokenizer = tokenizer
        self.created = int(time.time())

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self, completion_tokens: int, cached: int) -> dict:
        """cached: prompt tokens reused from a kept KV cache (the most any choice reused)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _logprobs(self, events, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for these token events: chat's ``content`` list, or the
        completions' parallel lists (``offset``: characters of the choice's text before them)."""
        if self.tokenizer is None:
            return None
        spell = lambda token: self.tokenizer.decode([token], skip_special=False)  # noqa: E731

        def entry(token: int, logprob: float) -> dict:
            return {"token": spell(token), "logprob": logprob, "bytes": list(spell(token).encode())}

        if self.chat:
            return {"content": [{**entry(e.token, e.logprob),
                                 "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                                for e in events]}
        offsets, at = [], offset
        for e in events:
            offsets.append(at)
            at += len(spell(e.token))
        return {"tokens": [spell(e.token) for e in events],
                "token_logprobs": [e.logprob for e in events],
                "top_logprobs": [{spell(t): lp for t, lp in e.top} for e in events],
                "text_offset": offsets}

    def whole(self, pieces: list[Piece], n: int) -> dict:
        texts, finish, used, cached = [""] * n, [None] * n, 0, 0
        events: list[list] = [[] for _ in range(n)]
        calls: list[list] = [[] for _ in range(n)]
        for p in pieces:
            texts[p.index] += p.text
            events[p.index] += p.tokens
            calls[p.index] += p.tool_calls
            if p.finish_reason is not None:
                finish[p.index] = p.finish_reason
                used += p.completion_tokens
                cached = max(cached, p.cached_tokens)
        if self.chat:
            choices = [{"index": i, "message": _message(texts[i], calls[i]),
                        "logprobs": self._logprobs(events[i]), "finish_reason": finish[i]}
                       for i in range(n)]
        else:
            choices = [{"index": i, "text": texts[i], "logprobs": self._logprobs(events[i]),
                        "finish_reason": finish[i]} for i in range(n)]
        return {**self._head(self.kind), "choices": choices, "usage": self._usage(used, cached)}

    def _chunk(self, index: int, text: str | None, finish_reason: str | None,
               role: bool = False, logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else \
                ({"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    async def sse(self, choices: Choices, n: int, include_usage: bool) -> AsyncIterator[str]:
        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        used, cached, sent = 0, 0, [0] * n  # sent: characters of each choice, text_offset
        try:
            if self.chat:
                for i in range(n):
                    yield event(self._chunk(i, None, None, role=True))
            async for p in choices.pieces():
                if p.text or p.tokens:
                    yield event(self._chunk(p.index, p.text, None,
                                            logprobs=self._logprobs(p.tokens, sent[p.index])))
                    sent[p.index] += len(p.text)
                if p.tool_calls:
                    calls = [call.as_openai(k) for k, call in enumerate(p.tool_calls)]
                    yield event({**self._head("chat.completion.chunk"), "choices": [
                        {"index": p.index, "delta": {"tool_calls": calls}, "logprobs": None,
                         "finish_reason": None}]})
                if p.finish_reason is not None:
                    used += p.completion_tokens
                    cached = max(cached, p.cached_tokens)
                    yield event(self._chunk(p.index, None, p.finish_reason))
            if include_usage:
                head = self._head("chat.completion.chunk" if self.chat else "text_completion")
                yield event({**head, "choices": [], "usage": self._usage(used, cached)})
        except GenerationFailed as e:
            yield event(error_body(str(e), "server_error"))
        yield "data: [DONE]\n\n"


def _message(text: str, calls: list) -> dict:
    """A chat choice's message; with tool calls (moeswap.server.tool_calls.ToolCall) the
    content is null when there is no text beside them, as OpenAI sends it."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None,
            "tool_calls": [call.as_openai() for call in calls]}


async def complete(reply: Reply, choices: Choices, n: int, request: Request) -> JSONResponse:
    """Collect the whole reply, cancelling it if the client goes away meanwhile."""
    async def collect():
        return [piece async for piece in choices.pieces()]

    task = asyncio.ensure_future(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            choices.cancel()
            raise ApiError(499, "client disconnected")
    try:
        pieces = task.result()
    except GenerationFailed as e:
        raise ApiError(500, str(e), type="server_error") from None
    return JSONResponse(reply.whole(pieces, n))
