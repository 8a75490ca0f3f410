"""What a check of a GGUF file finds: a rule id, a severity, a message naming the key or tensor,
and the fix. ``formats.validation`` holds the table of rules; doctor prints its findings and the
loader refuses a file with an error among them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

ERROR, WARNING = "error", "warning"

# A check yields (rule id, message); the table adds the rule's severity and fix.
Problem = tuple[str, str]


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    message: str
    fix: str


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    check: Callable[..., Iterator[Problem]] | None  # (GGUFFile, MoEView); None: raised by the reader
    summary: str
    fix: str
