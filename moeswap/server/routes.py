"""The HTTP routes: one small handler each, over an explicit ``ServerState``.

``Routes(state).register(app)`` adds them to a FastAPI app; ``ROUTE_TABLE`` lists them, and
``ROUTES`` (the metrics' path labels) comes from it. ``PUBLIC``: the routes served without the
API key.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from moeswap.context_window import ContextOverflow, fit_context
from moeswap.sampling import Sampler, SamplingParams
from moeswap.server.activity import expert_view
from moeswap.server.api_errors import ApiError, invalid
from moeswap.server.batching import NotRunning, QueueFull
from moeswap.server.chat_plan import ChatPlan, plan_chat
from moeswap.server.choices import Choices
from moeswap.server.metrics import render_metrics
from moeswap.server.replies import Reply, complete
from moeswap.server.schemas import MIN_TEMPERATURE, ChatBody, CompletionBody, SamplingBody
from moeswap.server.state import PAGE_FILES, ServerOptions, ServerState
from moeswap.server.tool_pieces import ToolCallPieces

# (method, path, Routes method name)
ROUTE_TABLE = (
    ("GET", "/health", "health"),
    ("GET", "/metrics", "metrics"),
    ("GET", "/v1/moeswap/experts", "experts"),
    ("GET", "/", "index"),
    ("GET", "/page.js", "page_js"),
    ("GET", "/page.css", "page_css"),
    ("GET", "/v1/models", "models"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/chat/completions", "chat_completions"),
)
PUBLIC = ("/health", "/", "/page.js", "/page.css")  # the page's three files hold no data
ROUTES = tuple(path for _, path, _ in ROUTE_TABLE)


class Routes:
    """The handlers, as methods over one server's state (nothing else is shared)."""

    def __init__(self, state: ServerState):
        self.state = state

    def register(self, app: FastAPI) -> None:
        for method, path, name in ROUTE_TABLE:
            app.add_api_route(path, getattr(self, name), methods=[method])

    async def health(self):
        scheduler = self.state.scheduler
        body = {"status": "ok" if scheduler.alive else "error", "queue_depth": scheduler.queue_depth,
                "batch_size": scheduler.active_count}
        return JSONResponse(body, status_code=200 if scheduler.alive else 503)

    async def metrics(self):
        s = self.state
        # waits for the current step to end, so off the event loop
        stats = await asyncio.to_thread(s.scheduler.read_model, getattr(s.runtime, "stats", dict))
        return PlainTextResponse(render_metrics(s.scheduler, s.http_counts, stats),
                                 media_type="text/plain; version=0.0.4")

    async def experts(self):
        s = self.state
        view = await asyncio.to_thread(s.scheduler.read_model, lambda: expert_view(
            s.runtime, s.activity, s.scheduler, s.options.model_name))
        return JSONResponse(view, headers={"Cache-Control": "no-store"})

    def _page_file(self, name: str) -> Response:
        return Response(self.state.page[name], media_type=PAGE_FILES[name])

    async def index(self):
        return self._page_file("index.html")

    async def page_js(self):
        return self._page_file("page.js")

    async def page_css(self):
        return self._page_file("page.css")

    async def models(self):
        return {"object": "list", "data": [{"id": name, "object": "model",
                                            "created": self.state.created, "owned_by": "moeswap"}
                                           for name in self.state.options.served_names]}

    async def completions(self, request: Request):
        runtime, options = self.state.runtime, self.state.options
        body = await self._parse(request, CompletionBody)
        _check_body(body, options)
        ids = await self.state.prompts.completion_ids(body.prompt)
        keep = 1 if ids and ids[0] == runtime.tokenizer.bos_id else 0
        return await self._respond(body, ids, keep, request, "text_completion", "cmpl")

    async def chat_completions(self, request: Request):
        body = await self._parse(request, ChatBody)
        _check_body(body, self.state.options)
        prompts = self.state.prompts
        plan = await prompts.off_loop(plan_chat, body, self.state.runtime)
        ids, keep = await prompts.chat_ids(plan.messages, **plan.variables)
        return await self._respond(body, ids, keep, request, "chat.completion", "chatcmpl", plan)

    async def _parse(self, request: Request, schema: type[SamplingBody]) -> SamplingBody:
        """The body as JSON (the guard has checked its Content-Type and size), parsed off the
        event loop: a few MB take tens of milliseconds."""
        body = await request.body()
        try:
            return await self.state.prompts.off_loop(schema.model_validate_json, body)
        except ValidationError as e:
            raise invalid(e.errors()) from None

    async def _respond(self, body: SamplingBody, ids: list[int], keep: int, request: Request,
                       kind: str, id_prefix: str, plan: ChatPlan | None = None):
        options = self.state.options
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
        params = _sampling_params(body)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            choices = Choices(self.state.scheduler, self.state.runtime.tokenizer, ids, n=body.n,
                              max_tokens=max_tokens or ctx, params=params, stops=stops,
                              logprobs=body.logprob_alternatives,
                              make_sampler=plan.grammar.sampler_factory()
                              if plan and plan.grammar else Sampler)
        except QueueFull as e:
            raise ApiError(429, str(e), type="requests", code="rate_limit_exceeded") from None
        except NotRunning as e:
            raise ApiError(503, str(e), type="server_error") from None
        if plan and plan.tool_convention:
            choices = ToolCallPieces(choices, self.state.runtime.tokenizer, plan.tool_convention)
        # the name the client asked for, as OpenAI echoes it (an alias included)
        reply = Reply(kind, f"{id_prefix}-{uuid.uuid4().hex}", body.model, len(ids),
                      None if body.logprob_alternatives is None else self.state.runtime.tokenizer)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = reply.sse(choices, body.n, include_usage)
            # a stream that never starts (client gone first) never runs its own cleanup
            weakref.finalize(stream, choices.cancel)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await complete(reply, choices, body.n, request)


def _sampling_params(body: SamplingBody) -> SamplingParams:
    temperature = body.temperature if body.temperature >= MIN_TEMPERATURE else 0.0
    seed = None if body.seed is None else body.seed % 2**62  # any int; torch takes 64 bits
    return SamplingParams(temperature=temperature, top_k=body.top_k, top_p=body.top_p,
                          min_p=body.min_p, repeat_penalty=body.repeat_penalty, seed=seed)


def _check_body(body: SamplingBody, options: ServerOptions) -> None:
    if options.strict_model and body.model not in options.served_names:
        names = ", ".join(f"`{name}`" for name in options.served_names)
        raise ApiError(404, f"the model `{body.model}` does not exist; this server has "
                            f"{names} (GET /v1/models; more names with --alias, or any name "
                            "without --strict-model)", param="model",
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
