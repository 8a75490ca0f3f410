"""The server renders chat templates in a child process, with a time and a memory limit.

A template is code from the model file. In the server's own process a loop of
``range(100000)`` inside another froze the event loop (``/health`` and SIGTERM went
unanswered) and a string or JSON blown up to gigabytes stayed in its memory. In a child the
worst a template can do is be killed: past ``seconds`` of wall time it is, and a new child
takes its place; its address space is capped at ``memory`` bytes over what it starts with, so
an allocation past that is a MemoryError there. Both come back as ``ChatTemplateLimit``, as do
the in-sandbox limits of moeswap.chat_template.

One child renders one template at a time (an ``asyncio.Lock`` keeps the others waiting in
line, not in threads); the time limit counts the render only. The child is spawned, not
forked: it imports Jinja and moeswap.chat_template only, never the model.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from typing import Any

from moeswap.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateFailed,
    ChatTemplateLimit,
    ChatTemplateRefused,
)

SECONDS = 5.0  # a long conversation renders in milliseconds
MEMORY = 512 * 2**20
KINDS = {cls.__name__: cls for cls in (ChatTemplateError, ChatTemplateFailed, ChatTemplateLimit,
                                       ChatTemplateRefused)}


class TemplateWorker:
    def __init__(self, template: ChatTemplate, *, seconds: float = SECONDS, memory: int = MEMORY):
        self.template = template
        self.seconds = seconds
        self.memory = memory
        self._context = multiprocessing.get_context("spawn")
        self._lock = asyncio.Lock()
        # a render whose request was cancelled goes on in its thread: the pipe stays its own
        self._pipe_lock = threading.Lock()
        self._process = None
        self._conn = None

    async def render(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        async with self._lock:
            return await asyncio.to_thread(self._render, messages, variables)

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._conn.close()
            self._process = self._conn = None

    def _render(self, messages: list[dict[str, Any]], variables: dict[str, Any]) -> str:
        with self._pipe_lock:
            return self._render_locked(messages, variables)

    def _render_locked(self, messages: list[dict[str, Any]], variables: dict[str, Any]) -> str:
        if self._process is None or not self._process.is_alive():
            self._start()
        try:
            self._conn.send((messages, variables))
            if not self._conn.poll(self.seconds):
                self.close()
                raise ChatTemplateLimit(f"the chat template ran past its time limit of "
                                        f"{self.seconds:g} s and was stopped")
            kind, text = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.close()  # the child died: a crash in Jinja, or killed by the system
            raise ChatTemplateFailed("the chat template's rendering process died") from None
        if kind != "ok":
            raise KINDS[kind](text)
        return text

    def _start(self) -> None:
        self.close()
        self._conn, child = self._context.Pipe()
        t = self.template
        self._process = self._context.Process(
            target=_child, args=(child, t.source, t.bos_token, t.eos_token, t.max_output,
                                 self.memory), name="moeswap-template", daemon=True)
        self._process.start()
        child.close()


def _child(conn, source: str, bos: str, eos: str, max_output: int, memory: int) -> None:
    _cap_memory(memory)
    template = ChatTemplate(source, bos_token=bos, eos_token=eos, max_output=max_output)
    while True:
        try:
            messages, variables = conn.recv()
        except EOFError:
            return  # the server is gone
        try:
            reply = ("ok", template.render(messages, **variables))
        except ChatTemplateError as e:
            reply = (type(e).__name__, str(e))
        del messages, variables
        conn.send(reply)


def _cap_memory(memory: int) -> None:
    """Limit the address space to what the process maps now plus ``memory`` (where the system
    enforces it: Linux; elsewhere the time limit still holds)."""
    import resource

    try:
        with open("/proc/self/status") as status:
            mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + memory, mapped + memory))
    except (OSError, ValueError, StopIteration):
        pass
