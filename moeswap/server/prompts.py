"""A request's prompt as token ids, built off the event loop and within limits.

Parsing the body, tokenizing and (through moeswap.server.template_worker) rendering the chat
template run outside the event loop, so /health and every other request are answered while a
large prompt is worked on: parsing and tokenizing on a pool of ``THREADS`` threads (a queue
there, not a thread per request), each call given ``SECONDS`` before its request gets a 400 (a
call already running finishes in the background; the body limit bounds it).

Before tokenizing, a prompt that cannot fit is refused from its length alone (policy
``error``): a token stands for at most ``max_token_bytes`` bytes of text
(moeswap.tokenizer.Tokenizer), so text of ``ctx * max_token_bytes`` bytes or more has at
least ``ctx`` tokens; a list of ids is counted. A chat prompt is checked on the template's
output, before it is tokenized. With ``--ctx-policy keep-recent``, of a prompt far longer than
the context only its start (BOS, system prompt) and its end are tokenized (``_recent_start``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from moeswap.chat_template import (
    ChatTemplateError,
    ChatTemplateFailed,
    ChatTemplateRefused,
)
from moeswap.context_window import common_prefix_length
from moeswap.server.api_errors import ApiError
from moeswap.server.template_worker import TemplateWorker
from moeswap.special_text import SpecialTexts

THREADS = 2
SECONDS = 30.0  # a 4 MiB prompt tokenizes in a few seconds
RECENT = 2  # keep-recent tokenizes this many contexts' worth of a long prompt's end


class Prompts:
    def __init__(self, runtime: Any, model_name: str, ctx: int, policy: str):
        self.runtime = runtime
        self.model_name = model_name
        self.ctx = ctx
        self.policy = policy
        self.max_token_bytes = runtime.tokenizer.max_token_bytes
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="moeswap-prompt")
        template = runtime.chat_template
        self.worker = TemplateWorker(template) if template is not None else None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, call: Callable, *args: Any) -> Any:
        future = asyncio.get_running_loop().run_in_executor(self.pool, call, *args)
        try:
            return await asyncio.wait_for(future, SECONDS)
        except asyncio.TimeoutError:
            raise ApiError(400, f"the prompt took over {SECONDS:g} s to read or tokenize; "
                                "send a shorter one", code="time_limit_exceeded") from None

    async def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            self._check_length(len(prompt), len(prompt), "prompt")
            vocab = self.runtime.tokenizer.vocab_size
            if prompt and not 0 <= min(prompt) <= max(prompt) < vocab:
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            return prompt
        size = len(prompt.encode())
        self._check_length(self._fewest_tokens(size), size, "prompt")
        cut = self._recent_start(prompt, 0)
        try:
            if cut is None:
                return await self.off_loop(self.runtime.encode, prompt)
            return await self.off_loop(self.runtime.tokenizer.encode, prompt[cut:])
        except ApiError:
            raise
        except Exception as e:
            raise ApiError(400, f"prompt: cannot tokenize: {e}", param="prompt") from None

    async def chat_ids(self, messages: list[dict], **variables: Any) -> tuple[list[int], int]:
        """(ids, how many leading ids keep-recent keeps: BOS and the system prompt).
        variables: more for the template (``tools``)."""
        text = await self._render(messages, add_generation_prompt=True, **variables)
        size = len(text.encode()) - 3 * text.count(SpecialTexts.MARK)  # a mark stands for no text
        self._check_length(self._fewest_tokens(size), size, "messages")
        system = []
        for m in messages:
            if self.policy != "keep-recent" or m["role"] not in ("system", "developer"):
                break
            system.append(m)
        alone = None
        if system:
            try:
                alone = await self._render(system, add_generation_prompt=False, **variables)
            except ApiError:
                pass
        bos_text = self.runtime.tokenizer.token_text(self.runtime.tokenizer.bos_id)
        head = max(len(alone) if alone and text.startswith(alone) else 0,
                   len(bos_text) if bos_text and text.startswith(bos_text) else 0)
        cut = self._recent_start(text, head)
        ids = await self.off_loop(self.runtime.rendered_chat_ids, text,
                                  None if cut is None else (head, cut))
        bos = 1 if ids and ids[0] == self.runtime.tokenizer.bos_id else 0
        if alone is None:
            return ids, bos
        alone_ids = await self.off_loop(self.runtime.rendered_chat_ids, alone)
        return ids, max(bos, common_prefix_length(alone_ids, ids))

    async def _render(self, messages: list[dict], **variables: Any) -> str:
        if self.worker is None:
            raise ApiError(400, self.runtime.no_chat_template(), param="messages",
                           code="chat_template_unavailable")
        protected = await self.off_loop(self.runtime.protected, messages)
        try:
            return await self.worker.render(protected, **variables)
        except ChatTemplateRefused as e:
            raise ApiError(400, str(e), param="messages", code="invalid_chat_template") from None
        except ChatTemplateFailed as e:  # the model file's fault, not the request's
            raise ApiError(500, f"{self.model_name}'s chat template (tokenizer.chat_template): "
                                f"{e}", type="server_error", code="chat_template_error") from None
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages", code="chat_template_limit") from None

    def _recent_start(self, text: str, head: int) -> int | None:
        """keep-recent keeps a prompt's first ``head`` characters' tokens (BOS, the system
        prompt) and its most recent ones, at most ``ctx``. Of a text far longer, only its last
        ``RECENT`` x ctx x max_token_bytes characters are tokenized (where they start is
        returned; None: tokenize it all): that many hold at least RECENT x ctx tokens, and
        tokenizing them alone can change only tokens near the cut (a tokenizer's merges are
        local), a context away from the kept ones."""
        if self.policy != "keep-recent" or not self.max_token_bytes:
            return None
        tail = RECENT * self.ctx * self.max_token_bytes
        return len(text) - tail if len(text) - head > 2 * tail else None

    def _fewest_tokens(self, size: int) -> int:
        """At least this many tokens in ``size`` bytes of text (0: no bound is known)."""
        return size // self.max_token_bytes if self.max_token_bytes else 0

    def _check_length(self, fewest_tokens: int, size: int, param: str) -> None:
        """Refuse a prompt that has at least ``ctx`` tokens, known before tokenizing it."""
        if self.policy == "error" and fewest_tokens >= self.ctx:
            raise ApiError(400, f"the prompt ({size} bytes or ids) is at least {fewest_tokens} "
                                f"tokens but the context holds {self.ctx} (--ctx), with room for "
                                "at least one new token; shorten it, raise --ctx, or use "
                                "--ctx-policy keep-recent", param=param,
                           code="context_length_exceeded")
