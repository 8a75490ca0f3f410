"""What one server holds: its options (``ServerOptions``) and its state (``ServerState``: the
runtime, the batch scheduler, the web page's bytes, the HTTP counters). ``create_app`` builds
the state once; the route handlers (moeswap.server.routes) read it and nothing else."""

from __future__ import annotations

import importlib.resources
import time
from dataclasses import dataclass
from typing import Any

from moeswap.context_window import POLICIES
from moeswap.errors import MoeswapError
from moeswap.server.activity import ExpertActivity
from moeswap.server.batching import BatchOptions, BatchScheduler
from moeswap.server.metrics import HttpCounts
from moeswap.server.prompts import Prompts

# A chat body of a full 128k-token context is well under 1 MiB of text.
MAX_BODY = 4 * 2**20

# The web page's files: name -> media type. Served without the API key: they hold no data.
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "page.js": "text/javascript; charset=utf-8",
              "page.css": "text/css; charset=utf-8"}


@dataclass(frozen=True)
class ServerOptions:
    model_name: str
    batch: BatchOptions = BatchOptions()
    aliases: tuple[str, ...] = ()  # more names requests may give for the model (--alias)
    # only those names are served (--strict-model); else any name, as llama-server does with
    # its one model
    strict_model: bool = False
    ctx_policy: str = "error"  # or "keep-recent" (moeswap.context_window)
    api_key: str | None = None
    max_body: int = MAX_BODY  # bytes of a request body (--max-body)
    bind_host: str = "127.0.0.1"  # answered in Host, beside localhost names (moeswap.server.hosts)
    allow_hosts: tuple[str, ...] = ()  # more Host names to answer (--allow-host)

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise MoeswapError("--api-key is empty: that would turn the key check off; give a "
                               "key, or leave the flag out to serve without one")
        if self.max_body < 1:
            raise MoeswapError(f"--max-body must be at least 1 byte, got {self.max_body}")
        if any(not alias.strip() for alias in self.aliases):
            raise MoeswapError("--alias is empty: give the name clients send as `model`")
        if self.ctx_policy not in POLICIES:
            raise MoeswapError(f"--ctx-policy must be one of {', '.join(POLICIES)}, "
                               f"got {self.ctx_policy!r}")


    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request may give as ``model``, the file's own first."""
        return (self.model_name, *self.aliases)


@dataclass
class ServerState:
    runtime: Any
    options: ServerOptions
    scheduler: BatchScheduler
    activity: ExpertActivity | None  # without one, the experts' ``last_use`` is all null
    page: dict[str, bytes]  # PAGE_FILES' contents
    http_counts: HttpCounts
    created: int  # when the server started (unix seconds), the model's "created"
    prompts: Prompts  # bodies parsed, prompts rendered and tokenized off the event loop

    @classmethod
    def create(cls, runtime: Any, options: ServerOptions,
               activity: ExpertActivity | None = None) -> ServerState:
        scheduler = BatchScheduler(runtime.model, options.batch)
        web = importlib.resources.files("moeswap.server") / "web"
        page = {name: (web / name).read_bytes() for name in PAGE_FILES}
        prompts = Prompts(runtime, options.model_name, options.batch.ctx, options.ctx_policy)
        return cls(runtime, options, scheduler, activity, page, HttpCounts(), int(time.time()),
                   prompts)
