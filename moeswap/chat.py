"""Interactive chat in the terminal: the model's own chat template, replies streamed.

Each line typed is a user turn; ``/reset`` forgets the conversation, ``/stats`` prints speed,
context use and the expert store's counters, ``/exit`` (or end of input) quits. On a terminal
lines are read with readline (editing, history); Ctrl-C at an empty prompt asks for a second
press before quitting, and during a reply stops the reply. A reply cut off by ``-n`` or by a
full context says so. The KV cache
is kept between turns: when the new prompt starts with everything already in the cache, only
the new tokens are prefilled. A conversation that outgrows ``ctx`` is refused (the turn is
dropped) or, with the keep-recent policy, cut to the system prompt and the most recent tokens.
A turn stopped part-way (Ctrl-C, an error in the model) keeps what its finished forwards put in
the cache, e.g. the first chunks of a long prompt: the session always knows which ids the cache
holds, so the next turn reuses them when the conversation still starts with them and gives the
reply a fresh cache would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, TextIO

from moeswap.context_window import POLICIES, common_prefix_length, fit_context
from moeswap.errors import MoeswapError
from moeswap.memory import STEP_TOKENS
from moeswap.generate import GenerationStats, check_step_tokens, prefill
from moeswap.runtime import peak_rss_bytes
from moeswap.sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    import torch

HELP = "commands: /reset (new conversation), /stats, /exit"
QUIT_HINT = "(Ctrl-C again, /exit or Ctrl-D to quit)"


@dataclass(frozen=True)
class ChatOptions:
    ctx: int = 4096  # positions of the whole conversation
    ctx_policy: str = "error"
    max_tokens: int = 512  # per reply
    system: str | None = None
    step_tokens: int = STEP_TOKENS  # most prompt tokens per forward (chunked prefill)

    def __post_init__(self):
        check_step_tokens(self.step_tokens)
        if self.ctx < 2:
            raise MoeswapError(f"--ctx must be >= 2, got {self.ctx}")
        if self.max_tokens < 1:
            raise MoeswapError(f"-n must be >= 1, got {self.max_tokens}")
        if self.ctx_policy not in POLICIES:
            raise MoeswapError(f"--ctx-policy must be one of {', '.join(POLICIES)}")


class ChatSession:
    def __init__(self, runtime: Any, options: ChatOptions, sampling: SamplingParams):
        if runtime.chat_template is None:  # its template does not compile
            raise MoeswapError(runtime.no_chat_template(
                "give --chat-template FILE|NAME, or use `moeswap run -p` for plain completion"))
        self.runtime = runtime
        self.options = options
        self.sampler = Sampler(sampling)
        self.stats = GenerationStats()
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = (
            [{"role": "system", "content": self.options.system}] if self.options.system else [])
        self.cache = None
        self.cached: list[int] = []  # the ids whose keys and values the cache holds
        self.cut_off = ""  # why the last reply stopped short, if it did

    def run(self, input: TextIO, output: TextIO) -> None:
        read = _terminal_reader(output) if input.isatty() else input.readline
        output.write(HELP + "\n")
        while True:
            line = read()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                self.reset()
                output.write("(conversation reset)\n")
            elif line == "/stats":
                output.write(self.stats_text() + "\n")
            elif line.startswith("/"):
                output.write(f"unknown command {line.split()[0]}; {HELP}\n")
            else:
                self.turn(line, output)
            output.flush()

    def turn(self, text: str, output: TextIO) -> None:
        """Answer one user message, streaming the reply to ``output``."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self._prompt_ids()
        except MoeswapError as e:
            self.messages.pop()
            output.write(f"error: {e}\n")
            return
        stream = self.runtime.tokenizer.stream(ids)
        reply = []
        self.cut_off = ""
        try:
            for token in self._reply_tokens(ids):
                piece = stream.push(token)
                reply.append(piece)
                output.write(piece)
                output.flush()
        except KeyboardInterrupt:
            output.write(" [interrupted]")
        if self.cut_off:
            output.write(f" [{self.cut_off}]")
        output.write("\n")
        self.messages.append({"role": "assistant", "content": "".join(reply)})

    def _prompt_ids(self) -> list[int]:
        ids = self.runtime.chat_prompt_ids(self.messages)
        keep = 1 if ids and ids[0] == self.runtime.tokenizer.bos_id else 0
        if self.options.system:
            alone = self.runtime.chat_prompt_ids(self.messages[:1], add_generation_prompt=False)
            keep = max(keep, common_prefix_length(alone, ids))
        return fit_context(ids, self.options.ctx, max_tokens=self.options.max_tokens,
                           policy=self.options.ctx_policy, keep_prefix=keep)

    def _reply_tokens(self, ids: list[int]) -> Iterator[int]:
        model = self.runtime.model
        if self.cache is None or len(ids) <= len(self.cached) or ids[:len(self.cached)] != self.cached:
            self.cache, self.cached = model.new_cache(), []
        started = time.perf_counter()
        new = ids[len(self.cached):]
        logits = self._feed(new)
        self.stats.prompt_tokens += len(new)
        self.stats.prompt_seconds += time.perf_counter() - started
        for _ in range(self.options.max_tokens):
            token = self.sampler.next_token(logits, self.cached)
            if token in self.runtime.tokenizer.stop_ids:
                return
            if len(self.cached) >= self.options.ctx:
                self.cut_off = f"cut off: the context (--ctx {self.options.ctx}) is full"
                return
            self.stats.generated_tokens += 1
            yield token
            started = time.perf_counter()
            logits = self._feed([token])
            self.stats.decode_tokens += 1
            self.stats.decode_seconds += time.perf_counter() - started
        self.cut_off = f"cut off at -n {self.options.max_tokens} tokens"

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens`` after the cached ids, ``step_tokens`` per forward: the next token's
        logits [V]. However it ends, ``cached`` is then the ids the cache holds: a forward that
        fails or is interrupted commits nothing, but the chunks fed before it stay."""
        fed = self.cached + tokens
        try:
            return prefill(self.runtime.model, [tokens], [self.cache], self.options.step_tokens)[0]
        finally:
            self.cached = fed[:self.cache.length]

    def stats_text(self) -> str:
        s = self.stats
        lines = [f"prompt: {s.prompt_tokens} tokens prefilled, {s.prompt_tokens_per_second:.2f} tokens/s"
                 f" | decode: {s.generated_tokens} tokens, {s.decode_tokens_per_second:.2f} tokens/s",
                 f"context: {len(self.cached)}/{self.options.ctx} tokens | peak RSS: "
                 f"{peak_rss_bytes() / 2**20:.0f} MiB"]
        store = self.runtime.stats()
        if "total" in store:  # a store's stats (replayed routing alone adds only "routing")
            t = store["total"]
            lines.append(f"experts: hit rate {t['hit_rate']:.1%}, {t['disk_bytes'] / 2**20:.1f} MiB "
                         f"read from disk, {t['transfer_bytes'] / 2**20:.1f} MiB moved up")
            lines += [f"{tier} tier: {v['held_bytes'] / 2**20:.1f} MiB of "
                      f"{v['budget_bytes'] / 2**20:.1f} MiB" for tier, v in store["tiers"].items()]
        return "\n".join(lines)


def _terminal_reader(output: TextIO):
    """Lines from the terminal through readline (editing, history): one Ctrl-C at the prompt
    asks for a second before quitting ('' ends the session, as end of input does)."""
    import readline  # noqa: F401  (imported for its effect: input() gains editing and history)

    def read() -> str:
        for presses in (1, 2):
            try:
                return input("> ") + "\n"
            except EOFError:
                return ""
            except KeyboardInterrupt:
                if presses == 2:
                    return ""
                output.write(f"\n{QUIT_HINT}\n")
                output.flush()

    return read
