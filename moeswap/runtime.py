"""What ``moeswap.load`` returns: a model with its tokenizer, ready to score and generate."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from moeswap.chat_template import ChatTemplate, ChatTemplateError
from moeswap.template_library import BUILT_IN, FALLBACK
from moeswap.errors import MoeswapError
from moeswap.memory import STEP_TOKENS
from moeswap.generate import GenerationStats, generate
from moeswap.sampling import Sampler, SamplingParams
from moeswap.tokenizer import Tokenizer, load_tokenizer


class Runtime:
    def __init__(self, model: Any, tokenizer: Tokenizer, expert_runner: Any = None,
                 replay: Any = None, chat_template: str | None = None):
        """chat_template: Jinja source in place of the model's own; a model with none falls
        back to moeswap.template_library's plain template (``chat_template_fallback``)."""
        self.model = model
        self.tokenizer = tokenizer
        self.expert_runner = expert_runner  # the offload store's builder, when one was asked for
        self.replay = replay  # moeswap.routing.replay.RoutingReplay, when routing is replayed
        self.chat_template: ChatTemplate | None = None
        self.chat_template_error: str | None = None  # why the model's template cannot be used
        source = chat_template or tokenizer.chat_template
        self.chat_template_fallback = not source  # chat runs on the plain template
        try:
            self.chat_template = ChatTemplate(
                source or BUILT_IN[FALLBACK], bos_token=tokenizer.token_text(tokenizer.bos_id),
                eos_token=tokenizer.token_text(tokenizer.eos_id))
        except ChatTemplateError as e:  # the model still completes plain prompts
            self.chat_template_error = str(e)

    @property
    def config(self):
        return self.model.config

    def stats(self) -> dict:
        """The expert store's metrics (moeswap.experts.store.ExpertStore.stats; none without
        one), and under "routing" what was replayed when the routing is a trace's."""
        stats = self.expert_runner.stats() if self.expert_runner is not None else {}
        if self.replay is not None:
            stats["routing"] = self.replay.stats()
        return stats

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Text is tokenized with BOS as the model asks and special-token text parsed
        (llama.cpp's behaviour for prompts); ids pass through unchanged."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(i) for i in prompt]

    def forward_logits(self, ids: str | Sequence[int] | torch.Tensor) -> torch.Tensor:
        """float32 logits [T, V] of every position of ``ids``, computed with a fresh cache."""
        tokens = ids.reshape(-1).long() if isinstance(ids, torch.Tensor) else \
            torch.tensor(self.encode(ids), dtype=torch.long)
        if tokens.numel() == 0:
            raise MoeswapError("forward_logits needs at least one token")
        return self.model.forward([tokens], [self.model.new_cache()])[0]

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, *,
                 stats: GenerationStats | None = None, stop_ids: frozenset[int] | None = None,
                 step_tokens: int = STEP_TOKENS, **sampling: Any) -> Iterator[int]:
        """Yield new token ids. ``sampling``: SamplingParams fields (temperature, top_k,
        top_p, min_p, repeat_penalty, repeat_last_n, seed); temperature=0 is greedy.
        Generation ends at the tokenizer's stop ids unless ``stop_ids`` replaces them.
        The prompt is prefilled at most ``step_tokens`` tokens per forward."""
        try:
            params = SamplingParams(**sampling)
        except TypeError as e:
            raise MoeswapError(f"unknown sampling option: {e}; known: temperature, top_k, "
                               "top_p, min_p, repeat_penalty, repeat_last_n, seed") from None
        stops = self.tokenizer.stop_ids if stop_ids is None else frozenset(stop_ids)
        return generate(self.model, self.encode(prompt), max_tokens=max_tokens,
                        sampler=Sampler(params), stop_ids=stops, stats=stats,
                        step_tokens=step_tokens)

    def chat_prompt_ids(self, messages: list[dict[str, Any]], **variables: Any) -> list[int]:
        """The token ids of ``messages`` rendered by the model's chat template; control-token
        text inside a message is text (moeswap.tokenizer.Tokenizer.protect)."""
        if self.chat_template is None:
            raise MoeswapError(self.no_chat_template())
        return self.rendered_chat_ids(self.chat_template.render(self.protected(messages),
                                                                **variables))

    def no_chat_template(self, fix: str = "give a plain prompt instead") -> str:
        """Why chat cannot render (its template does not compile), and ``fix``."""
        return f"this model's chat template cannot be used ({self.chat_template_error}); {fix}"

    def protected(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with their text contents marked for ``rendered_chat_ids``."""
        return [{**m, "content": self.tokenizer.protect(m["content"])}
                if isinstance(m.get("content"), str) else m for m in messages]

    def rendered_chat_ids(self, text: str, drop: tuple[int, int] | None = None) -> list[int]:
        """Token ids of the chat template's output for ``protected`` messages (``drop``: see
        Tokenizer.encode_rendered)."""
        bos = self.tokenizer.token_text(self.tokenizer.bos_id)
        # The template writes BOS itself when it wants one; do not add a second.
        return self.tokenizer.encode_rendered(text, add_special=not (bos and text.startswith(bos)),
                                              drop=drop)


def load(path: str | os.PathLike, *, threads: int | None = None,
         verbose_log: Callable[[str], None] | None = None, expert_runner: Any = None,
         tokenizer_cache_dir: str | os.PathLike | None = None, recorder: Any = None,
         replay_routing: str | os.PathLike | None = None, context_tokens: int = 0,
         step_tokens: int = 0, chat_template: str | None = None, kv_type: str = "f32",
         force: bool = False, repack: bool = False, in_ram: bool = False) -> Runtime:
    """Open a .gguf file or a Hugging Face folder.

    threads: the kernels' threads and torch's intra-op threads (torch's is process-wide);
    None: the engine's and torch's defaults.
    verbose_log: called with one line per tensor as it is mapped (name, shape, type, where).
    expert_runner: what computes a GGUF model's routed experts (moeswap.models.load_model).
    tokenizer_cache_dir: where converted GGUF tokenizers are kept (default ~/.cache/moeswap).
    recorder: handed every routing decision (moeswap.routing.recorder.RoutingRecorder).
    replay_routing: a routing trace (.npz) whose decisions replace the router's, for measuring
    the store with real routing on a generated model (docs/OFFLOAD.md, "Replayed routing").
    chat_template: Jinja source in place of the model's own chat template
    (moeswap.template_library.template_source reads a name or a file).
    context_tokens, step_tokens: what the store's budget charged each sequence for
    (moeswap.memory.HostCharge); caches are sized to it (0: they grow as they fill).
    kv_type: of the KV caches, 'f32' (default; exact against float32 references), 'f16'
    (the command line's default, as llama.cpp's: half the RAM) or 'q8_0' (17/32 of f16's; GGUF
    families whose attention runs as ggml graphs, models.loader.load_model).
    force: load a GGUF file that moeswap doctor reports an error in (formats.validation); by
    default it is refused in one line before anything is built.
    repack: dense quantized matrices in ggml's repacked CPU layouts (models.loader.load_model;
    the command line's default, off with --exact-tiers).
    in_ram: a resident GGUF model's data copied into RAM with huge pages (models.loader.load_model;
    the command line's default where it fits, off with --mmap).
    """
    from moeswap.models import load_model
    from moeswap.routing.replay import RoutingReplay

    path = Path(path)
    if not path.exists():
        raise MoeswapError(f"{path}: no such file or folder")
    if threads is not None:
        if threads < 1:
            raise MoeswapError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    replay = RoutingReplay.load(replay_routing) if replay_routing is not None else None
    if path.is_file() and not force:  # before the tokenizer reads the vocabulary
        refuse_invalid_file(path)
    try:
        tokenizer = load_tokenizer(path, cache_dir=tokenizer_cache_dir)
    except MoeswapError:
        raise
    except Exception as e:  # a damaged vocabulary must end in one line, not a traceback
        raise MoeswapError(f"{path}: cannot build the tokenizer: {type(e).__name__}: {e}") from e
    model = load_model(path, verbose_log=verbose_log, threads=threads, expert_runner=expert_runner,
                       recorder=recorder, replay=replay, context_tokens=context_tokens,
                       step_tokens=step_tokens, kv_type=kv_type, validate=False,
                       repack=repack, in_ram=in_ram)
    return Runtime(model, tokenizer, expert_runner, replay, chat_template)


def refuse_invalid_file(path: Path) -> None:
    """The loader's validation (formats.validation.refuse_invalid) of the GGUF file at ``path``."""
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.formats.validation import refuse_invalid

    gguf = GGUFFile.open(path)
    try:
        refuse_invalid(gguf)
    finally:
        gguf.close()


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
