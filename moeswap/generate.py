"""Generation: prefill the prompts, then decode one token per step, as generators.

``generate_batch`` runs several sequences at once: each has its own KV cache and sampler and
sits at its own position; one forward call per step serves all sequences still running. The
model is anything with ``new_cache()`` and ``forward(tokens, caches)`` (see
moeswap.models.CausalLM). Stop tokens end a sequence and are not yielded.

Prompts are prefilled in chunks of at most ``step_tokens`` tokens per sequence and forward
(llama.cpp's micro-batch, ``n_ubatch``): attention scores, activations and logits are then
held for one chunk, not the whole prompt, and a sliding-window layer's cache holds at most
window - 1 + ``step_tokens`` positions (moeswap.memory.kv_cache_bytes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import torch

from moeswap.errors import MoeswapError
from moeswap.memory import STEP_TOKENS
from moeswap.sampling import GREEDY, Sampler


class Model(Protocol):
    def new_cache(self): ...

    def forward(self, tokens: list[torch.Tensor], caches: list,
                last_only: bool = False) -> list[torch.Tensor]: ...


@dataclass
class GenerationStats:
    """Filled in while generating. Time counts only the work inside the generator, not the
    caller's handling of each yielded token."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_tokens: int = 0  # tokens evaluated by decode steps (summed over sequences)
    decode_seconds: float = 0.0
    generated_tokens: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)  # per sequence: stop | length

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class _Sequence:
    ids: list[int]  # prompt and generated tokens
    cache: object
    sampler: Sampler
    generated: int = 0
    finish_reason: str | None = None


def check_step_tokens(step_tokens: int) -> None:
    if step_tokens < 1:
        raise MoeswapError(f"--step-tokens must be >= 1, got {step_tokens}")


def prefill(model: Model, prompts: Sequence[Sequence[int]], caches: list,
            step_tokens: int = STEP_TOKENS) -> list[torch.Tensor]:
    """Run the prompts through the model, at most ``step_tokens`` of each per forward; each
    one's logits for its next token: [V], a copy (a view would keep its chunk's [T, V] logits
    alive while the next chunk runs). Each forward carries the next chunk of every prompt not
    yet fed, and only those sequences' caches."""
    check_step_tokens(step_tokens)
    last: list[torch.Tensor | None] = [None] * len(prompts)
    for start in range(0, max((len(p) for p in prompts), default=0), step_tokens):
        fed = [i for i, p in enumerate(prompts) if len(p) > start]
        logits = model.forward(
            [torch.tensor(list(prompts[i][start:start + step_tokens]), dtype=torch.long)
             for i in fed], [caches[i] for i in fed], last_only=True)
        for i, rows in zip(fed, logits):
            last[i] = rows[-1].clone()
    return last


def decode_step(model: Model, last_tokens: Sequence[int], caches: list) -> list[torch.Tensor]:
    """One token per sequence in, each sequence's next-token logits [V] out."""
    logits = model.forward([torch.tensor([t], dtype=torch.long) for t in last_tokens], caches,
                           last_only=True)
    return [row[-1] for row in logits]


def generate_batch(model: Model, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                   samplers: Sequence[Sampler] | None = None, stop_ids: frozenset[int] = frozenset(),
                   stats: GenerationStats | None = None,
                   step_tokens: int = STEP_TOKENS) -> Iterator[list[tuple[int, int]]]:
    """Yields, per step, the (sequence index, token id) of every sequence that produced one;
    prompts are prefilled ``step_tokens`` at a time."""
    if any(len(p) == 0 for p in prompts):
        raise MoeswapError("cannot generate from an empty prompt: give at least one token "
                           "(the tokenizer's BOS when there is no text)")
    samplers = list(samplers) if samplers is not None else [Sampler(GREEDY) for _ in prompts]
    stats = stats if stats is not None else GenerationStats()
    sequences = [_Sequence(list(p), model.new_cache(), s) for p, s in zip(prompts, samplers)]
    stats.finish_reasons = [None] * len(sequences)
    if max_tokens <= 0:
        stats.finish_reasons = ["length"] * len(sequences)
        return

    started = time.perf_counter()
    logits = prefill(model, [s.ids for s in sequences], [s.cache for s in sequences],
                     step_tokens)
    stats.prompt_tokens += sum(len(p) for p in prompts)
    stats.prompt_seconds += time.perf_counter() - started
    active = list(range(len(sequences)))
    while active:
        started = time.perf_counter()
        step = []
        for index, row in zip(active, logits):
            sequence = sequences[index]
            _check_finite(row, len(sequence.ids))
            token = sequence.sampler.next_token(row, sequence.ids)
            if token in stop_ids:
                sequence.finish_reason = "stop"
                continue
            sequence.ids.append(token)
            sequence.generated += 1
            step.append((index, token))
            if sequence.generated >= max_tokens:
                sequence.finish_reason = "length"
        active = [i for i in active if sequences[i].finish_reason is None]
        sample_seconds = time.perf_counter() - started
        stats.generated_tokens += len(step)
        for index, sequence in enumerate(sequences):
            stats.finish_reasons[index] = sequence.finish_reason
        if step:
            yield step
        if not active:
            break
        started = time.perf_counter()
        logits = decode_step(model, [sequences[i].ids[-1] for i in active],
                             [sequences[i].cache for i in active])
        stats.decode_tokens += len(active)
        stats.decode_seconds += time.perf_counter() - started + sample_seconds


def _check_finite(row: torch.Tensor, position: int) -> None:
    """NaN or +Inf logits [V] (max propagates NaN) would sample nonsense or an empty reply."""
    if not torch.isfinite(row.max()):
        raise MoeswapError(f"the model computed NaN or infinite logits at position {position}; "
                           "its weights are damaged (run `moeswap doctor` on the file), or "
                           "--force loaded a file doctor reports errors in")


def generate(model: Model, prompt: Sequence[int], *, max_tokens: int, sampler: Sampler | None = None,
             stop_ids: frozenset[int] = frozenset(),
             stats: GenerationStats | None = None,
             step_tokens: int = STEP_TOKENS) -> Iterator[int]:
    """Prefill ``prompt`` ``step_tokens`` at a time, then yield up to ``max_tokens`` new token
    ids, ending at a stop id."""
    for step in generate_batch(model, [prompt], max_tokens=max_tokens,
                               samplers=[sampler or Sampler(GREEDY)], stop_ids=stop_ids,
                               stats=stats, step_tokens=step_tokens):
        for _, token in step:
            yield token
