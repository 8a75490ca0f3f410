"""The middleware in front of every route: the API key check and the HTTP response counts."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from moeswap.server.api_errors import error_body
from moeswap.server.metrics import HttpCounts
from moeswap.server.routes import PUBLIC, ROUTES


class GuardMiddleware:
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
