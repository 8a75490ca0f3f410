"""Errors meant for the user: the CLI prints their message as one line and exits non-zero."""

from __future__ import annotations

from pathlib import Path


class MoeswapError(Exception):
    """An error whose message already names the file, key or tensor and the fix."""


class GGUFFormatError(MoeswapError):
    """The file is not a readable GGUF. ``rule`` is the doctor rule id it maps to."""

    def __init__(self, path: str | Path, rule: str, message: str):
        self.path = str(path)
        self.rule = rule
        super().__init__(f"{self.path}: {message}")
