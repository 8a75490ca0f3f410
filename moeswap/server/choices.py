"""From the scheduler's token events to the text of each choice, as an async stream.

``Choices`` submits one scheduler request per choice (``n``), turns tokens into text
(whole characters only, stop strings cut and held back while they may still be starting) and
yields ``Piece``s. Leaving the iteration early (client gone, stop string hit) cancels the
requests, which frees their KV caches.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable, Sequence

from moeswap.sampling import Sampler, SamplingParams
from moeswap.server.batching import BatchScheduler, Event
from moeswap.tokenizer import Tokenizer


class GenerationFailed(Exception):
    """The batching loop reported an error for this request."""


@dataclass(frozen=True)
class Piece:
    index: int  # which choice
    text: str = ""
    finish_reason: str | None = None  # set on the choice's last piece
    completion_tokens: int = 0  # set on the last piece
    # with logprobs: the token events since the previous piece (their text is in this one's,
    # or held back by a stop string)
    tokens: tuple[Event, ...] = ()
    cached_tokens: int = 0  # set on the last piece: prompt tokens reused from a kept cache
    ids: tuple[int, ...] = ()  # set on the last piece: every token the choice generated
    tool_calls: tuple[Any, ...] = ()  # moeswap.server.tool_calls.ToolCall, where parsed


class StopStrings:
    """Emits text up to the first stop string; holds back a tail that could begin one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        hold = max((k for s in self.stops for k in range(1, min(len(s), len(self.pending) + 1))
                    if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Choices:
    """The n requests of one API call. Creating it queues them (raises QueueFull, cancelling
    any already queued, when the queue cannot take all n); ``pieces`` streams their text."""

    def __init__(self, scheduler: BatchScheduler, tokenizer: Tokenizer, prompt_ids: list[int], *,
                 n: int, max_tokens: int, params: SamplingParams, stops: Sequence[str],
                 logprobs: int | None = None,
                 make_sampler: Callable[[SamplingParams], Sampler] = Sampler):
        """logprobs: alternatives to report per token (None: no logprobs). make_sampler: each
        choice's sampler (moeswap.server.constrained's, for a grammar)."""
        loop = asyncio.get_running_loop()
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.stops = stops
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.requests = []
        try:
            for index in range(n):
                # Choices with a fixed seed would all draw the same tokens; offset it per choice.
                seeded = params if params.seed is None else replace(params, seed=params.seed + index)

                def on_event(event: Event, index: int = index) -> None:
                    loop.call_soon_threadsafe(self.events.put_nowait, (index, event))

                self.requests.append(scheduler.submit(
                    prompt_ids, max_tokens=max_tokens, sampler=make_sampler(seeded),
                    stop_ids=tokenizer.stop_ids, on_event=on_event, logprobs=logprobs))
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for request in self.requests:
            request.cancel()

    async def pieces(self) -> AsyncIterator[Piece]:
        n = len(self.requests)
        texts = [self.tokenizer.stream(self.prompt_ids) for _ in range(n)]
        cuts = [StopStrings(self.stops) for _ in range(n)]
        counts = [0] * n
        generated: list[list[int]] = [[] for _ in range(n)]
        held: list[list[Event]] = [[] for _ in range(n)]  # token events not yet on a piece
        running = n
        try:
            while running:
                index, event = await self.events.get()
                cut = cuts[index]
                if cut.stopped:
                    continue  # events already on their way when the stop string hit
                if event.error is not None:
                    raise GenerationFailed(event.error)
                if event.token is not None:
                    counts[index] += 1
                    generated[index].append(event.token)
                    if event.logprob is not None:
                        held[index].append(event)
                    text = cut.push(texts[index].push(event.token))
                    if cut.stopped:
                        self.requests[index].cancel()
                        running -= 1
                        yield Piece(index, text, "stop", counts[index], _take(held[index]),
                                    self.requests[index].cached, tuple(generated[index]))
                    elif text:
                        yield Piece(index, text, tokens=_take(held[index]))
                    continue
                running -= 1
                yield Piece(index, cut.flush(), event.finish_reason, counts[index],
                            _take(held[index]), self.requests[index].cached,
                            tuple(generated[index]))
        finally:
            self.cancel()


def _take(events: list[Event]) -> tuple[Event, ...]:
    """The held events, and the list emptied."""
    taken = tuple(events)
    events.clear()
    return taken
