"""The middleware in front of every route: what a request must pass before a handler sees it,
in this order, each refusal an OpenAI error body:

- ``Host`` on the allow-list (moeswap.server.hosts): 403 ``host_not_allowed``;
- the API key, before the body is read: 401 ``invalid_api_key``;
- a POST body labelled ``application/json`` (a web page's form or ``text/plain`` POST needs no
  CORS preflight; a JSON one does, and the server answers none): 415;
- a body of at most ``--max-body`` bytes, refused by its Content-Length before it is read, or
  as soon as it passes the limit: 413 ``request_too_large``.

It also counts responses for /metrics, and returns freed heap to the system after every POST,
refused ones too (a large body's buffers would otherwise stay in the process).
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse

from moeswap.memory import format_size
from moeswap.server.api_errors import error_body
from moeswap.server.batching import heap_trimmer
from moeswap.server.hosts import HostAllowList
from moeswap.server.metrics import HttpCounts
from moeswap.server.routes import PUBLIC, ROUTES
from moeswap.server.state import ServerOptions


class GuardMiddleware:
    def __init__(self, app, options: ServerOptions, counts: HttpCounts):
        self.app = app
        self.key = options.api_key.encode() if options.api_key is not None else None
        self.hosts = HostAllowList(options.bind_host, options.allow_hosts)
        self.max_body = options.max_body
        self.counts = counts
        self.trim = heap_trimmer()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            return await self._admit(scope, receive, send)
        try:
            await self._admit(scope, receive, send)
        finally:
            await asyncio.to_thread(self.trim)

    async def _admit(self, scope, receive, send):
        path = scope["path"] if scope["path"] in ROUTES else "other"  # bounded label set
        headers = dict(scope["headers"])

        async def refuse(status: int, message: str, code: str | None,
                         type: str = "invalid_request_error"):
            self.counts.add(path, status)
            await JSONResponse(error_body(message, type, code), status_code=status)(scope, receive, send)

        host = headers.get(b"host")
        if not self.hosts.allows(host):
            name = host.decode("latin-1")
            return await refuse(403, f"Host {name!r} is not allowed (a guard against DNS "
                                     f"rebinding); start the server with --allow-host "
                                     f"{name.rpartition(':')[0] or name} to accept it",
                                "host_not_allowed")
        if self.key is not None and scope["path"] not in PUBLIC and not self._authorized(headers):
            return await refuse(401, "missing or incorrect API key: send "
                                     "'Authorization: Bearer KEY'", "invalid_api_key")
        if scope["method"] == "POST":
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                return await refuse(415, "the body must be sent as 'Content-Type: "
                                         "application/json'", "unsupported_media_type")
            body = await self._read_body(headers, receive)
            if body is None:
                return await refuse(413, f"the request body is over {format_size(self.max_body)} "
                                         "(--max-body)", "request_too_large")
            receive = _replay(body, receive)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counts.add(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)

    async def _read_body(self, headers: dict, receive) -> bytes | None:
        """The whole body, or None when it is over the limit (then it is not read further)."""
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b""  # the client left; the route sees an empty body and its disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # compare_digest takes time independent of where the bytes differ
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def _replay(body: bytes, receive):
    """A receive that hands the app the body already read, then the client's own messages
    (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
