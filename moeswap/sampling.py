"""Choosing the next token: small pure functions composed in llama.cpp's default order.

llama.cpp's chain is penalties -> top-k -> top-p -> min-p -> temperature -> draw: the cut-offs
see the untempered distribution, and temperature only reshapes what survives. The filters work
on *candidates*, a pair (ids [C], logits [C]) sorted by logit, descending, so that after top-k
the rest touches k entries instead of the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from moeswap.errors import MoeswapError

Candidates = tuple[torch.Tensor, torch.Tensor]  # (ids [C] int64, logits [C] float32), best first


@dataclass(frozen=True)
class SamplingParams:
    """Defaults are llama.cpp's (llama-cli). ``temperature <= 0`` means greedy."""

    temperature: float = 0.8
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # how many recent tokens the penalty looks at; -1: all
    seed: int | None = None  # None: a fresh random seed

    def __post_init__(self):
        problems = []
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0.0:
            problems.append(f"repeat_penalty must be > 0 (1 turns it off), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            problems.append(f"repeat_last_n must be >= -1, got {self.repeat_last_n}")
        if problems:
            raise MoeswapError("invalid sampling settings: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams(temperature=0.0)


def repetition_penalty(logits: torch.Tensor, recent_ids: Sequence[int], penalty: float) -> torch.Tensor:
    """Make tokens seen recently less likely: positive logits / penalty, negative * penalty
    (once per distinct token, as llama.cpp and transformers do). logits: [V]."""
    if penalty == 1.0 or not recent_ids:
        return logits
    ids = torch.tensor(sorted(set(recent_ids)), dtype=torch.long)
    seen = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return out


def top_k(logits: torch.Tensor, k: int) -> Candidates:
    """The k best tokens (all when k is 0 or >= V), sorted. logits: [V]."""
    if 0 < k < logits.numel():
        values, ids = torch.topk(logits, k)
    else:
        values, ids = torch.sort(logits, descending=True)
    return ids, values


def top_p(candidates: Candidates, p: float) -> Candidates:
    """The fewest best candidates whose probabilities sum to at least p (at least one)."""
    if p >= 1.0:
        return candidates
    ids, logits = candidates
    cumulative = torch.cumsum(torch.softmax(logits, dim=0), dim=0)  # [C]
    keep = int(torch.searchsorted(cumulative, torch.tensor([p], dtype=cumulative.dtype))) + 1
    return ids[:keep], logits[:keep]


def min_p(candidates: Candidates, p: float) -> Candidates:
    """Candidates whose probability is at least p times the best one's."""
    if p <= 0.0:
        return candidates
    ids, logits = candidates
    keep = logits >= logits[0] + torch.log(torch.tensor(p, dtype=logits.dtype))
    keep[0] = True
    return ids[keep], logits[keep]


def temperature(candidates: Candidates, t: float) -> Candidates:
    ids, logits = candidates
    return ids, logits / t


def draw(candidates: Candidates, generator: torch.Generator) -> int:
    ids, logits = candidates
    probs = torch.softmax(logits.double(), dim=0)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])


def greedy_token(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


class Sampler:
    """One sequence's sampler: its settings and its own seeded random stream."""

    def __init__(self, params: SamplingParams = GREEDY):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def next_token(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """logits: [V] float32 for the next position; history: the ids so far (prompt included)."""
        if self.params.greedy:
            return greedy_token(self._penalised(logits, history))
        return draw(self.candidates(logits, history), self.generator)

    def candidates(self, logits: torch.Tensor, history: Sequence[int]) -> Candidates:
        """What a draw chooses among: the filters' survivors with their tempered logits."""
        p = self.params
        kept = min_p(top_p(top_k(self._penalised(logits, history), p.top_k), p.top_p), p.min_p)
        return temperature(kept, p.temperature)

    def _penalised(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        p = self.params
        start = 0 if p.repeat_last_n == -1 else max(0, len(history) - p.repeat_last_n)
        return repetition_penalty(logits.float(), history[start:], p.repeat_penalty)
