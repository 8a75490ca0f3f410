"""One timing loop for both engines' sequential runs, and the figures every run reports.

Before timing, each engine runs one untimed warm-up (``WARM_UP`` tokens of the first prompt and
one step), so first-call costs -- page-table faults on a mapped file, kernel set-up -- are not
in the figures. Each prompt is then fed in ``prefill_chunk``-token pieces (both engines the
same), ``prompt_repeats`` times from an empty cache (its time the median: a short prompt's one
timing is a fraction of a second, within the machine's drift), then greedy single-token steps.
Times cover the engine's work only; the memory samples between steps are outside them. Time
to first token counts from the scenario's start, so for several prompts run one after another
it includes the wait for the earlier ones; it and the wall time leave out a prompt's repeats
but the last (a server feeds a prompt once).
"""

from __future__ import annotations

import statistics
import time
from typing import Protocol

from moeswap.bench.memory import MemoryTrace
from moeswap.bench.scenarios import RunSpec


class Session(Protocol):
    def reset(self) -> None:
        """Start a fresh sequence (empty KV cache)."""

    def feed(self, ids: list[int]) -> int:
        """Evaluate ``ids`` after what was fed before -> the greedy next token."""


WARM_UP = 16


def warm_up(session: Session, spec: RunSpec) -> None:
    session.reset()
    token = session.feed(spec.prompts[0][:WARM_UP])
    session.feed([token])
    session.reset()


def run_sequential(session: Session, spec: RunSpec, memory: MemoryTrace) -> dict:
    start = time.perf_counter()
    prompt_s = decode_s = repeated_s = 0.0  # repeated_s: the wall time of extra repeats
    first_tokens, outputs = [], []
    for prompt in spec.prompts:
        seconds = []
        for repeat in range(spec.prompt_repeats):
            repeat_began = time.perf_counter()
            session.reset()
            seconds.append(0.0)
            for at in range(0, len(prompt), spec.prefill_chunk):
                began = time.perf_counter()
                token = session.feed(prompt[at: at + spec.prefill_chunk])
                seconds[-1] += time.perf_counter() - began
                memory.sample("prefill")
            if repeat < spec.prompt_repeats - 1:
                repeated_s += time.perf_counter() - repeat_began
        prompt_s += statistics.median(seconds)
        first_tokens.append(time.perf_counter() - start - repeated_s)
        tokens = [token]
        for _ in range(spec.gen_tokens - 1):  # the last token needs no forward
            began = time.perf_counter()
            token = session.feed([token])
            decode_s += time.perf_counter() - began
            tokens.append(token)
            memory.sample("decode")
        outputs.append(tokens)
    return figures(prompt_tokens=sum(map(len, spec.prompts)), prompt_s=prompt_s,
                   decode_tokens=sum(len(t) - 1 for t in outputs), decode_s=decode_s,
                   first_tokens=first_tokens, wall_s=time.perf_counter() - start - repeated_s,
                   outputs=outputs)


def figures(*, prompt_tokens: int, prompt_s: float, decode_tokens: int, decode_s: float,
            first_tokens: list[float], wall_s: float, outputs: list[list[int]]) -> dict:
    generated = sum(map(len, outputs))
    return {"prompt_tokens": prompt_tokens, "prompt_s": prompt_s,
            "prompt_tok_s": prompt_tokens / prompt_s if prompt_s else None,
            "decode_tokens": decode_tokens, "decode_s": decode_s,
            "decode_tok_s": decode_tokens / decode_s if decode_s else None,
            "ttft_s": sum(first_tokens) / len(first_tokens), "ttft_max_s": max(first_tokens),
            "generated_tokens": generated, "wall_s": wall_s,
            "throughput_tok_s": generated / wall_s if wall_s else None, "outputs": outputs}


def median_seconds(function, repeats: int) -> float:
    """The median of ``repeats`` timed calls, after one untimed call (it prepares the graph and
    faults the pages in)."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
