"""The OpenAI-compatible HTTP API over a loaded model: ``create_app(runtime, ...)``.

Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions and
/v1/chat/completions (``"stream": true`` sends OpenAI's SSE chunks, then ``data: [DONE]``),
GET /v1/moeswap/experts (the expert cache, moeswap.server.activity), and the web page: GET /
with /page.js and /page.css (package data in moeswap/server/web/, no build step, nothing
fetched from elsewhere). Every error a client can cause is a 4xx with OpenAI's body
``{"error": {"message", "type", "param", "code"}}``. With an API key, every route but /health
and the page's three files needs ``Authorization: Bearer KEY``, compared in constant time; the
page holds no data and sends the key the user types.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import json
import time
import uuid
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from moeswap.chat_template import ChatTemplateError
from moeswap.context_window import POLICIES, ContextOverflow, common_prefix_length, fit_context
from moeswap.errors import MoeswapError
from moeswap.sampling import SamplingParams
from moeswap.server.activity import ExpertActivity, expert_view
from moeswap.server.batching import BatchOptions, BatchScheduler, NotRunning, QueueFull
from moeswap.server.choices import Choices, GenerationFailed, Piece
from moeswap.server.metrics import HttpCounts, render_metrics
from moeswap.server.schemas import MIN_TEMPERATURE, ChatBody, CompletionBody, SamplingBody


# The web page's files: name -> media type. Served without the API key: they hold no data.
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "page.js": "text/javascript; charset=utf-8",
              "page.css": "text/css; charset=utf-8"}
PUBLIC = ("/health", "/", "/page.js", "/page.css")
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
          "/v1/moeswap/experts", "/", "/page.js", "/page.css")


@dataclass(frozen=True)
class ServerOptions:
    model_name: str
    batch: BatchOptions = BatchOptions()
    ctx_policy: str = "error"  # or "keep-recent" (moeswap.context_window)
    api_key: str | None = None

    def __post_init__(self):
        if self.ctx_policy not in POLICIES:
            raise MoeswapError(f"--ctx-policy must be one of {', '.join(POLICIES)}, "
                               f"got {self.ctx_policy!r}")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.code, e.param), status_code=e.status)


def create_app(runtime: Any, options: ServerOptions,
               activity: ExpertActivity | None = None) -> FastAPI:
    """activity: the recorder the model was loaded with (``moeswap.load(recorder=...)``), for
    the experts' last use on /v1/moeswap/experts; without one, ``last_use`` is all null."""
    scheduler = BatchScheduler(runtime.model, options.batch)
    web = importlib.resources.files("moeswap.server") / "web"
    page = {name: (web / name).read_bytes() for name in PAGE_FILES}
    http_counts = HttpCounts()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="moeswap", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.scheduler = scheduler
    app.add_middleware(_GuardMiddleware, api_key=options.api_key, counts=http_counts)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError):
        return _error_response(e)

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, e: HTTPException):
        return _error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: "
                                        f"{e.detail}", code="not_found" if e.status_code == 404 else None))

    @app.get("/health")
    async def health():
        body = {"status": "ok" if scheduler.alive else "error", "queue_depth": scheduler.queue_depth,
                "batch_size": scheduler.active_count}
        return JSONResponse(body, status_code=200 if scheduler.alive else 503)

    @app.get("/metrics")
    async def metrics():
        # waits for the current step to end, so off the event loop
        stats = await asyncio.to_thread(scheduler.read_model, getattr(runtime, "stats", dict))
        return PlainTextResponse(render_metrics(scheduler, http_counts, stats),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/moeswap/experts")
    async def experts():
        view = await asyncio.to_thread(scheduler.read_model, lambda: expert_view(
            runtime, activity, scheduler, options.model_name))
        return JSONResponse(view, headers={"Cache-Control": "no-store"})

    @app.get("/")
    async def index():
        return Response(page["index.html"], media_type=PAGE_FILES["index.html"])

    @app.get("/page.js")
    async def page_js():
        return Response(page["page.js"], media_type=PAGE_FILES["page.js"])

    @app.get("/page.css")
    async def page_css():
        return Response(page["page.css"], media_type=PAGE_FILES["page.css"])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": options.model_name, "object": "model",
                                            "created": created, "owned_by": "moeswap"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionBody)
        _check_body(body, options)
        try:
            ids = runtime.encode(body.prompt)
        except Exception as e:
            raise ApiError(400, f"prompt: cannot tokenize: {e}", param="prompt") from None
        if any(not 0 <= i < runtime.tokenizer.vocab_size for i in ids):
            raise ApiError(400, f"prompt: token ids must be in [0, {runtime.tokenizer.vocab_size})",
                           param="prompt")
        keep = 1 if ids and ids[0] == runtime.tokenizer.bos_id else 0
        return await _respond(body, ids, keep, request, "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatBody)
        _check_body(body, options)
        messages = [m.as_template_input() for m in body.messages]
        try:
            ids = runtime.chat_prompt_ids(messages)
            keep = _system_prefix_length(runtime, messages, ids) \
                if options.ctx_policy == "keep-recent" else 0
        except MoeswapError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await _respond(body, ids, keep, request, "chat.completion", "chatcmpl")

    async def _respond(body: SamplingBody, ids: list[int], keep: int, request: Request,
                       kind: str, id_prefix: str):
        ctx = options.batch.ctx
        max_tokens = body.max_tokens if kind == "text_completion" else body.reply_limit
        try:
            ids = fit_context(ids, ctx, max_tokens=max_tokens or ctx, policy=options.ctx_policy,
                              keep_prefix=keep)
        except ContextOverflow as e:
            raise ApiError(400, str(e), param="messages" if kind != "text_completion" else "prompt",
                           code="context_length_exceeded") from None
        if not ids:
            raise ApiError(400, "prompt: empty; give at least one token", param="prompt")
        temperature = body.temperature if body.temperature >= MIN_TEMPERATURE else 0.0
        seed = None if body.seed is None else body.seed % 2**62  # any int; torch takes 64 bits
        params = SamplingParams(temperature=temperature, top_k=body.top_k, top_p=body.top_p,
                                min_p=body.min_p, repeat_penalty=body.repeat_penalty, seed=seed)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            choices = Choices(scheduler, runtime.tokenizer, ids, n=body.n,
                              max_tokens=max_tokens or ctx, params=params, stops=stops)
        except QueueFull as e:
            raise ApiError(429, str(e), type="requests", code="rate_limit_exceeded") from None
        except NotRunning as e:
            raise ApiError(503, str(e), type="server_error") from None
        reply = _Reply(kind, f"{id_prefix}-{uuid.uuid4().hex}", options.model_name, len(ids))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = reply.sse(choices, body.n, include_usage)
            # a stream that never starts (client gone first) never runs its own cleanup
            weakref.finalize(stream, choices.cancel)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _complete(reply, choices, body.n, request)

    return app


async def _parse(request: Request, schema: type[SamplingBody]) -> SamplingBody:
    """The body as JSON whatever its Content-Type says (curl -d sends a form type)."""
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as e:
        raise _invalid(e.errors()) from None


def _invalid(errors: list) -> ApiError:
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if first.get("type") == "json_invalid":
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
    else:
        message = f"{where or 'body'}: {first.get('msg', 'invalid value')}"
    return ApiError(400, message, param=where or None, code="invalid_value")


def _check_body(body: SamplingBody, options: ServerOptions) -> None:
    if body.model != options.model_name:
        raise ApiError(404, f"the model `{body.model}` does not exist; this server has "
                            f"`{options.model_name}` (GET /v1/models)", param="model",
                       code="model_not_found")
    if body.n > options.batch.max_batch:
        raise ApiError(400, f"n: {body.n} choices asked; at most {options.batch.max_batch} "
                            "(--max-batch)", param="n")
    unsupported = body.unsupported_fields()
    if unsupported:
        raise ApiError(400, f"{', '.join(unsupported)}: not supported by moeswap",
                       param=unsupported[0], code="unsupported_parameter")
    if isinstance(body.stop, list) and len(body.stop) > 4:
        raise ApiError(400, "stop: at most 4 stop strings", param="stop")


def _system_prefix_length(runtime: Any, messages: list[dict], ids: list[int]) -> int:
    """How many leading prompt tokens the keep-recent policy keeps: BOS and the system prompt."""
    system = []
    for m in messages:
        if m["role"] not in ("system", "developer"):
            break
        system.append(m)
    bos = 1 if ids and ids[0] == runtime.tokenizer.bos_id else 0
    if not system:
        return bos
    try:
        alone = runtime.chat_prompt_ids(system, add_generation_prompt=False)
    except ChatTemplateError:
        return bos
    return max(bos, common_prefix_length(alone, ids))


async def _complete(reply: "_Reply", choices: Choices, n: int, request: Request) -> JSONResponse:
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


class _Reply:
    """Builds the OpenAI response objects of one call."""

    def __init__(self, kind: str, id: str, model: str, prompt_tokens: int):
        self.kind, self.id, self.model, self.prompt_tokens = kind, id, model, prompt_tokens
        self.created = int(time.time())

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def whole(self, pieces: list[Piece], n: int) -> dict:
        texts, finish, used = [""] * n, [None] * n, 0
        for p in pieces:
            texts[p.index] += p.text
            if p.finish_reason is not None:
                finish[p.index] = p.finish_reason
                used += p.completion_tokens
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                        "logprobs": None, "finish_reason": finish[i]} for i in range(n)]
        else:
            choices = [{"index": i, "text": texts[i], "logprobs": None,
                        "finish_reason": finish[i]} for i in range(n)]
        return {**self._head(self.kind), "choices": choices, "usage": self._usage(used)}

    def _chunk(self, index: int, text: str | None, finish_reason: str | None,
               role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else \
                ({"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    async def sse(self, choices: Choices, n: int, include_usage: bool) -> AsyncIterator[str]:
        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        used = 0
        try:
            if self.chat:
                for i in range(n):
                    yield event(self._chunk(i, None, None, role=True))
            async for p in choices.pieces():
                if p.text:
                    yield event(self._chunk(p.index, p.text, None))
                if p.finish_reason is not None:
                    used += p.completion_tokens
                    yield event(self._chunk(p.index, None, p.finish_reason))
            if include_usage:
                head = self._head("chat.completion.chunk" if self.chat else "text_completion")
                yield event({**head, "choices": [], "usage": self._usage(used)})
        except GenerationFailed as e:
            yield event(error_body(str(e), "server_error"))
        yield "data: [DONE]\n\n"


class _GuardMiddleware:
    """Checks the API key before anything else reads the request, and counts responses."""

    def __init__(self, app, api_key: str | None, counts: HttpCounts):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.counts = counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in ROUTES else "other"  # bounded label set
        if self.key is not None and scope["path"] not in PUBLIC and not self._authorized(scope):
            response = JSONResponse(error_body("missing or incorrect API key: send "
                                               "'Authorization: Bearer KEY'", "invalid_request_error",
                                               "invalid_api_key"), status_code=401)
            self.counts.add(path, 401)
            return await response(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counts.add(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest takes time independent of where the bytes differ
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
