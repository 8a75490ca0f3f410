"""The OpenAI-compatible HTTP API over a loaded model: ``create_app(runtime, ...)``.

Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions and
/v1/chat/completions (``"stream": true`` sends OpenAI's SSE chunks, then ``data: [DONE]``),
GET /v1/moeswap/experts (the expert cache, moeswap.server.activity), and the web page: GET /
with /page.js and /page.css (package data in moeswap/server/web/, no build step, nothing
fetched from elsewhere). Every error a client can cause is a 4xx with OpenAI's body
``{"error": {"message", "type", "param", "code"}}``. With an API key, every route but /health
and the page's three files needs ``Authorization: Bearer KEY``, compared in constant time; the
page holds no data and sends the key the user types.

Here the app is assembled; the pieces: moeswap.server.state (ServerOptions, ServerState),
routes (one handler per route), guard (API key, response counts), replies (OpenAI response
objects), api_errors (the error body).
"""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException

from moeswap.server.activity import ExpertActivity
from moeswap.server.api_errors import ApiError, error_response
from moeswap.server.guard import GuardMiddleware
from moeswap.server.routes import Routes
from moeswap.server.state import ServerOptions, ServerState

__all__ = ["ServerOptions", "create_app"]


def create_app(runtime: Any, options: ServerOptions,
               activity: ExpertActivity | None = None) -> FastAPI:
    """activity: the recorder the model was loaded with (``moeswap.load(recorder=...)``), for
    the experts' last use on /v1/moeswap/experts; without one, ``last_use`` is all null."""
    state = ServerState.create(runtime, options, activity)
    if runtime.chat_template_error:  # one line, and the server serves plain completions
        print(f"moeswap serve: warning: {runtime.chat_template_error}; /v1/chat/completions "
              "answers 400 chat_template_unavailable", file=sys.stderr)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        try:
            yield
        finally:
            state.scheduler.stop()
            state.prompts.close()

    app = FastAPI(title="moeswap", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.scheduler = state.scheduler
    app.add_middleware(GuardMiddleware, options=options, counts=state.http_counts)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    Routes(state).register(app)
    return app


async def _on_api_error(request: Request, e: ApiError):
    return error_response(e)


async def _on_http_error(request: Request, e: HTTPException):
    return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: "
                                   f"{e.detail}", code="not_found" if e.status_code == 404 else None))
