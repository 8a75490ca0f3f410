"""Record a routing trace by running the engine: prefill each prompt, then greedy decode.

Every token the engine runs is in the trace: a prompt of P tokens with ``new_tokens`` N gives
P + N rows (fewer when a stop token ends it first), the prompt's rows tagged *prefill* and the
generated ones *decode*. Prompts run in batches (one forward per step serves the whole batch),
so the trace also shows the engine recording a batch, not just one sequence.

It loads and runs the model, so it sits beside ``runtime`` and ``generate``, above routing/
(which holds the trace format, the recorder and everything that reads a trace).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from moeswap.errors import MoeswapError
from moeswap.generate import generate_batch
from moeswap.routing.recorder import RoutingRecorder
from moeswap.routing.traces import RoutingTrace, model_name
from moeswap.runtime import load


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str | Sequence[int]  # text (tokenized as `moeswap run` does) or token ids


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
    """A prompts file: plain text, one prompt per non-empty line (named FILE:LINE), or ``.jsonl``
    with one object per line: {"prompt": "...", "name": "..." (optional)}."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise MoeswapError(f"{path}: no such prompts file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MoeswapError(f"{path}: cannot read prompts ({e}); give a UTF-8 text file") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        name = f"{path.name}:{number}"
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
                prompts.append(Prompt(str(row.get("name", name)), str(row["prompt"])))
            except (ValueError, KeyError, AttributeError):
                raise MoeswapError(f"{path}:{number}: expected a JSON object with a \"prompt\" "
                                   "string (and optionally \"name\")") from None
        else:
            prompts.append(Prompt(name, line))
    if not prompts:
        raise MoeswapError(f"{path}: no prompts in the file; write one prompt per line")
    return prompts


def record_trace(model_path: str | os.PathLike, prompts: Sequence[Prompt], *, new_tokens: int,
                 router_probs: bool = False, threads: int | None = None, batch_size: int = 8,
                 stop_ids: frozenset[int] | None = None,
                 on_prompts_done: Callable[[int], None] | None = None) -> RoutingTrace:
    """Load the model with a recorder, run every prompt (greedy) and return the trace.

    new_tokens: tokens generated and run through the model per prompt (0: prefill only).
    stop_ids: tokens that end a sequence early (None: the tokenizer's; frozenset(): never).
    on_prompts_done: called with how many prompts have finished, after each batch.
    """
    if new_tokens < 0:
        raise MoeswapError(f"tokens to generate must be >= 0, got {new_tokens}")
    if not prompts:
        raise MoeswapError("no prompts given; give -p TEXT or --prompts FILE")
    recorder = RoutingRecorder(router_probs=router_probs)
    runtime = load(model_path, threads=threads, recorder=recorder)
    config = runtime.config
    if not config.moe_layers:
        raise MoeswapError(f"{model_path}: this {config.arch} model has no routed experts; "
                           "there is no routing to trace")
    stops = runtime.tokenizer.stop_ids if stop_ids is None else stop_ids
    for first in range(0, len(prompts), batch_size):
        batch = []
        for prompt in prompts[first:first + batch_size]:
            batch.append(runtime.encode(prompt.text))
            if not batch[-1]:
                raise MoeswapError(f"prompt {prompt.name} has no tokens; give some text")
        # One more token than new_tokens: the last sampled token is never run, so N tokens run
        # through the model need N + 1 sampled.
        for _ in generate_batch(runtime.model, batch, max_tokens=new_tokens + 1, stop_ids=stops):
            pass
        if on_prompts_done is not None:
            on_prompts_done(first + len(batch))
    return recorder.trace(model=model_name(model_path, runtime.model.source), arch=config.arch,
                          layers=config.moe_layers, n_experts=config.n_expert,
                          k=config.n_expert_used, prompt_names=[p.name for p in prompts],
                          source=f"moeswap trace of {Path(model_path).name}: greedy, "
                                 f"{new_tokens} new tokens per prompt")
