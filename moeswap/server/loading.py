"""The server before its model is loaded: ``LoadingGate`` answers at once, then hands every
request to the app the load built.

`moeswap serve` binds its port and starts answering first, so that a client (or an
orchestrator's health check) sees the server come up while a big model loads for minutes:
GET /health answers 503 ``{"status": "loading"}``, the web page's three files are served (they
hold no data; the page says the model is loading), and every other request answers 503 with
OpenAI's error body (code ``model_loading``), until ``load()`` — run on a thread of its own — returns
the app; its lifespan (the batch scheduler) then starts and it serves everything. A load that
fails ends the server; ``error`` holds what it raised.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import threading
from contextlib import AsyncExitStack
from typing import Any, Callable

from fastapi.responses import JSONResponse, Response

from moeswap.server.api_errors import error_body
from moeswap.server.state import PAGE_FILES

LOADING_MESSAGE = "the model is still loading; retry once GET /health answers 200"


class LoadingGate:
    """An ASGI app: 503s while ``load`` runs, then the app it returned (a FastAPI app from
    moeswap.server.app.create_app). ``on_failure`` is called when ``load`` raises (the CLI
    stops uvicorn there)."""

    def __init__(self, load: Callable[[], Any], on_failure: Callable[[], None] = lambda: None):
        self._load = load
        self._on_failure = on_failure
        self.app: Any = None
        self.error: BaseException | None = None
        self._exit = AsyncExitStack()
        self._task: asyncio.Task | None = None
        web = importlib.resources.files("moeswap.server") / "web"
        self._page = {("/" if name == "index.html" else f"/{name}"): (web / name).read_bytes()
                      for name in PAGE_FILES}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return await send({"type": "websocket.close", "code": 1013})  # try again later
        path = scope["path"]
        if path == "/health":
            response = JSONResponse({"status": "loading"}, status_code=503)
        elif path in self._page:
            response = Response(self._page[path], media_type=PAGE_FILES[
                "index.html" if path == "/" else path[1:]])
        else:
            response = JSONResponse(error_body(LOADING_MESSAGE, "server_error", "model_loading"),
                                    status_code=503, headers={"Retry-After": "1"})
        await response(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._task = asyncio.create_task(self._start())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._task is not None:
                    self._task.cancel()  # a load still running is left to its daemon thread
                await self._exit.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        try:
            app = await _on_daemon_thread(self._load)
            # the app's own lifespan (create_app's: the batch scheduler), entered as uvicorn
            # would have at startup
            await self._exit.enter_async_context(app.router.lifespan_context(app))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 (the CLI reports it once the server stops)
            self.error = e
            self._on_failure()
            return
        self.app = app


async def _on_daemon_thread(function: Callable[[], Any]) -> Any:
    """``function()`` on a daemon thread: unlike asyncio.to_thread's pool, a load still running
    at Ctrl-C does not hold the process open until it ends."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run():
        try:
            result = function()
        except BaseException as e:  # noqa: BLE001 (handed to the awaiting coroutine)
            loop.call_soon_threadsafe(_settle, done, None, e)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=run, name="moeswap-load", daemon=True).start()
    return await done


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
