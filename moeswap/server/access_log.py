"""uvicorn's access log without the polling: the web page asks for /v1/moeswap/experts every
second, health checks and Prometheus poll /health and /metrics; at INFO they would bury the
requests a user sent. ``quiet_polling()`` logs those at DEBUG (`moeswap serve --log-level
debug` shows them) and every other request as before."""

from __future__ import annotations

import logging

POLLED = frozenset({"/health", "/metrics", "/v1/moeswap/experts"})
ACCESS_LOGGER = "uvicorn.access"


class PollingAtDebug(logging.Filter):
    """uvicorn's access record: args (client, method, path with query, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str)):
            return True
        if args[2].partition("?")[0] not in POLLED:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.DEBUG)


def quiet_polling() -> None:
    """Install the filter on uvicorn's access logger (once; uvicorn's logging config, applied
    when its Config is made, keeps a logger's filters)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, PollingAtDebug) for f in logger.filters):
        logger.addFilter(PollingAtDebug())
