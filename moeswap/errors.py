"""Errors meant for the user: the CLI prints their message as one line and exits non-zero."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class MoeswapError(Exception):
    """An error whose message already names the file, key or tensor and the fix."""


class GGUFFormatError(MoeswapError):
    """The file is not a readable GGUF. ``rule`` is the doctor rule id it maps to."""

    def __init__(self, path: str | Path, rule: str, message: str):
        self.path = str(path)
        self.rule = rule
        super().__init__(f"{self.path}: {message}")


@contextmanager
def write_or_raise(path: str | Path, what: str) -> Iterator[None]:
    """Run the block that writes ``path``; an OSError becomes a MoeswapError that names the
    file, ``what`` it is ("the trace") and the usual fix."""
    try:
        yield
    except OSError as e:
        raise MoeswapError(f"{path}: cannot write {what} ({e.strerror or e}); "
                           "check that its folder exists and is writable") from None
