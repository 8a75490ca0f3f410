"""Continuous batching: one background thread decodes every active request in one forward call
per step.

Requests wait in a bounded queue (``submit`` raises ``QueueFull`` when it is full: the server's
429). Between steps, waiting requests join the batch while it has fewer than ``max_batch``;
a joining request's prompt goes into the same forward call as the running requests' last
tokens, so the MoE layers route all of them together and each expert is fetched once per step
for every token that picked it. A step carries at most ``step_tokens`` tokens: running requests'
one each first, then prompts in order of arrival, a long prompt cut into chunks over several
steps (chunked prefill) — which bounds a step's working memory (activations, logits) and keeps
a long prompt from stalling everyone's next token. Each request keeps its own KV cache and
sampler; a cancelled request (its client went away) leaves the batch before the next step. A
request ends at a stop id, at ``max_tokens``, or when its sequence fills ``ctx``; its cache
stays in its slot for a later prompt with the same prefix (moeswap.server.slots). After each
step, freed heap memory goes back to the system (``malloc_trim`` on glibc): otherwise the
allocator keeps the steps' and caches' freed blocks, and the process grew with every request
served (docs/SERVER.md, "Load test").

Events go back through each request's ``on_event`` callback, called on the batching thread:
the callback must only hand the event over (put it on a queue), never block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moeswap.errors import MoeswapError
from moeswap.formats.file_watch import FileWatch
from moeswap.memory import STEP_TOKENS
from moeswap.sampling import Sampler
from moeswap.server.slots import Slot, Slots


class QueueFull(MoeswapError):
    """Too many requests are waiting; the client should retry later."""


class NotRunning(MoeswapError):
    """The batching loop is not running (not started, stopped, or it died)."""


@dataclass(frozen=True)
class BatchOptions:
    max_batch: int = 8  # requests decoded together
    queue_size: int = 64  # requests waiting to join the batch
    ctx: int = 4096  # positions per request: prompt and generated tokens
    step_tokens: int = STEP_TOKENS  # tokens per forward; longer prompts are prefilled in chunks

    def __post_init__(self):
        for name in ("max_batch", "queue_size", "ctx", "step_tokens"):
            if getattr(self, name) < 1:
                raise MoeswapError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.step_tokens < self.max_batch:
            raise MoeswapError(f"--step-tokens {self.step_tokens} is below --max-batch "
                               f"{self.max_batch}: every running request needs a token per step")


@dataclass(frozen=True)
class Event:
    """One generated token, or the end of the request (finish_reason 'stop' | 'length' |
    'cancelled'), or an error that ended it."""

    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None  # the token's, when the request asked for logprobs
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their logprobs


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: frozenset[int]
    on_event: Callable[[Event], None]
    ids: list[int] = field(default_factory=list)  # prompt and generated tokens
    cache: Any = None
    slot: Slot | None = None  # where the cache came from and goes back to
    fed: int = 0  # tokens of ``ids`` already in the cache
    cached: int = 0  # prompt tokens that were already in the slot's cache
    generated: int = 0
    cancelled: bool = False
    logprobs: int | None = None  # alternatives to report per token (None: no logprobs)

    def cancel(self) -> None:
        """Leave the batch before its next step (safe from any thread)."""
        self.cancelled = True


@dataclass
class Counters:
    """What the scheduler has done since it started; read by /metrics."""

    requests_admitted: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    requests_rejected: int = 0  # queue full
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens: reused from a kept cache, not prefilled
    generated_tokens: int = 0
    steps: int = 0
    busy_seconds: float = 0.0  # inside forward and sampling
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (end time, tokens out)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second of wall time over the last ``window`` seconds."""
        now = time.monotonic()
        tokens = sum(n for t, n in list(self.recent) if now - t <= window)
        return tokens / window


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> Event:
    """logits [V] -> the token's event with its log-probability under the model's own
    distribution (before the sampler's filters and temperature, as OpenAI reports it) and
    the ``top`` most likely tokens' (llama-server's n_probs)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [V]
    values, ids = torch.topk(logp, top) if top else (logp[:0], logp[:0].long())  # [top]
    return Event(token=token, logprob=float(logp[token]),
                 top=tuple(zip(ids.tolist(), values.tolist())))


def heap_trimmer() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``: returns the heap's free pages to the system (a no-op where
    the C library has no such call)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class BatchScheduler:
    def __init__(self, model: Any, options: BatchOptions):
        self.model = model
        self.options = options
        self.counters = Counters()
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._wake = threading.Condition()
        self._model_lock = threading.Lock()  # held while the model computes a step
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._here = False  # stepped by the caller (drain), not a thread
        self._trim_heap = heap_trimmer()
        self._slots = Slots(options.max_batch, model.new_cache)
        self._model_files = FileWatch.of_source(getattr(model, "source", None))  # issue 23

    def start(self, here: bool = False) -> None:
        """Steps on a thread of the scheduler's own, or (``here``) on the caller's, in
        ``drain``."""
        self._stopping, self._here = False, here
        if not here:
            self._thread = threading.Thread(target=self._loop, name="moeswap-batching",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        self._here = False
        for request in list(self._waiting) + self._active:
            self._emit(request, Event(finish_reason="cancelled"))
        self._waiting.clear()
        self._active = []

    @property
    def alive(self) -> bool:
        return self._here or self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_count(self) -> int:
        return len(self._active)

    def submit(self, prompt_ids: list[int], *, max_tokens: int, sampler: Sampler,
               stop_ids: frozenset[int], on_event: Callable[[Event], None],
               logprobs: int | None = None) -> Request:
        """Queue a request; its tokens arrive through ``on_event``. The caller has already
        fitted the prompt into the context (moeswap.context_window)."""
        if not prompt_ids:
            raise MoeswapError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.options.ctx:
            raise MoeswapError(f"the prompt is {len(prompt_ids)} tokens; the context holds "
                               f"{self.options.ctx}")
        if not self.alive:
            raise NotRunning("the batching loop is not running; restart the server")
        request = Request(list(prompt_ids), max_tokens, sampler, stop_ids, on_event,
                          ids=list(prompt_ids), logprobs=logprobs)
        with self._wake:
            if len(self._waiting) >= self.options.queue_size:
                self._drop_cancelled_waiting()
            if len(self._waiting) >= self.options.queue_size:
                self.counters.requests_rejected += 1
                raise QueueFull(f"{len(self._waiting)} requests are already waiting "
                                f"(--queue {self.options.queue_size}); retry later")
            self._waiting.append(request)
            self._wake.notify()
        return request

    def _drop_cancelled_waiting(self) -> None:
        for request in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(request)
            self._finish(request, "cancelled")

    def read_model(self, read: Callable[[], Any]) -> Any:
        """Call ``read`` (e.g. the expert store's stats) between steps, never during one."""
        with self._model_lock:
            return read()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._active:
                    self._wake.wait()
                if self._stopping:
                    return
                self._admit()
            self._step_safely()

    def drain(self) -> None:
        """Run the loop on the calling thread until every submitted request has ended (after
        ``start(here=True)``). The bench steps on the thread that loaded the model: libgomp
        spins at ggml's barriers only while its threads fit the cores, and a second thread
        with a team of its own made a batched step ~1.4x slower here (docs/KERNELS.md,
        "Thread discipline")."""
        while True:
            with self._wake:
                self._admit()
                if not self._active:
                    return
            self._step_safely()

    def _admit(self) -> None:
        """Waiting requests into the batch while it has room (under ``_wake``)."""
        while self._waiting and len(self._active) < self.options.max_batch:
            request = self._waiting.popleft()
            if request.cancelled:
                self._finish(request, "cancelled")
                continue
            request.slot, request.cache, request.cached = self._slots.take(request.ids)
            request.fed = request.cached
            self._active.append(request)
            self.counters.requests_admitted += 1
            self.counters.prompt_tokens += len(request.ids)
            self.counters.cached_tokens += request.cached

    def _step_safely(self) -> None:
        try:
            self._step()
        except Exception as e:  # the loop must outlive any one step
            for request in list(self._active):
                self._finish(request, None, error=f"generation failed: {type(e).__name__}: {e}")

    def _feeds(self) -> list[tuple[Request, int]]:
        """(request, how many of its unfed tokens) for this step, at most ``step_tokens`` in
        all: a decoding request's one token first, then prompts (chunks) in order of arrival."""
        left = self.options.step_tokens
        feeds = []
        for request in sorted(self._active, key=lambda r: len(r.ids) - r.fed > 1):  # stable
            n = min(len(request.ids) - request.fed, left)
            if n:
                feeds.append((request, n))
                left -= n
        return feeds

    def _step(self) -> None:
        self._decode()
        # The step's activations and the caches that grew or ended are freed blocks now; the
        # allocator would keep them. Under 1 ms on this process's ~100 MB heap.
        self._trim_heap()

    def _decode(self) -> None:
        for request in [r for r in self._active if r.cancelled]:
            self._finish(request, "cancelled")
        feeds = self._feeds()
        if not feeds:
            return
        batch = [r for r, _ in feeds]
        started = time.perf_counter()
        try:
            with self._model_lock:
                self._model_files.check()  # a file changed in place would SIGBUS the forward
                logits = self.model.forward(
                    [torch.tensor(r.ids[r.fed:r.fed + n], dtype=torch.long) for r, n in feeds],
                    [r.cache for r in batch], last_only=True)
        except Exception as e:  # a failed step ends its requests, never the server
            for request in batch:
                self._finish(request, None, error=f"generation failed: {type(e).__name__}: {e}")
            return
        produced = 0
        for (request, n), rows in zip(feeds, logits):
            request.fed += n
            if request.fed < len(request.ids):
                continue  # a prompt chunk: its next chunk comes in a later step
            try:
                token = request.sampler.next_token(rows[-1], request.ids)
            except Exception as e:  # e.g. settings that overflow: ends this request only
                self._finish(request, None, error=f"sampling failed: {type(e).__name__}: {e}")
                continue
            if token in request.stop_ids:
                self._finish(request, "stop")
                continue
            request.ids.append(token)
            request.generated += 1
            produced += 1
            self._emit(request, Event(token=token) if request.logprobs is None else
                       token_logprobs(rows[-1], token, request.logprobs))
            if request.generated >= request.max_tokens or len(request.ids) >= self.options.ctx:
                self._finish(request, "length")
        c = self.counters
        c.steps += 1
        c.generated_tokens += produced
        c.busy_seconds += time.perf_counter() - started
        c.recent.append((time.monotonic(), produced))

    def _finish(self, request: Request, reason: str | None, error: str | None = None) -> None:
        if request in self._active:
            self._active.remove(request)
        if request.slot is not None:  # its cache stays in the slot, unless a step failed in it
            self._slots.give_back(request.slot, request.ids[:request.fed], keep=error is None)
            request.slot = request.cache = None
        key = reason or "error"
        self.counters.requests_finished[key] = self.counters.requests_finished.get(key, 0) + 1
        self._emit(request, Event(finish_reason=reason, error=error))

    @staticmethod
    def _emit(request: Request, event: Event) -> None:
        try:
            request.on_event(event)
        except Exception:  # a listener that is gone (closed event loop) must not stop the loop
            request.cancel()
