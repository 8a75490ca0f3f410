"""The consoles commands print with: rich on a terminal; piped, plain and unwrapped, so that
`moeswap doctor f.gguf | grep expert_count` finds whole keys and a planned command pastes."""

from __future__ import annotations

import sys

from rich.console import Console

PIPED_WIDTH = 10_000  # wide enough that no table row or command wraps


def stdout_console(**options) -> Console:
    if sys.stdout.isatty():
        return Console(**options)
    return Console(width=PIPED_WIDTH, no_color=True, soft_wrap=True,
                   **{k: v for k, v in options.items() if k != "soft_wrap"})
