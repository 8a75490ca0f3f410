"""Writes moeswap/bench/inputs/long_conversation.json: a multi-turn conversation about the Python standard
library whose answers are functions taken from held-out stdlib files (every 20th file, the
rule of training/train.py), so the built-in model sees text like its training data.

    python scripts/make_bench_inputs.py     # rewrites the file; the stdlib sources are PSF-licensed

The other inputs (batch8_prompts.json, conflict_prompt.txt) are written by hand.
"""

from __future__ import annotations

import ast
import json
import sysconfig
import textwrap
from pathlib import Path

HELD_OUT_EVERY = 20
TARGET_CHARS = 36_000  # ~11k tokens of the built-in tokenizer (3.2 chars a token): room for 8192
MAX_FUNCTION_CHARS = 1_600


def held_out_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = sorted(p for p in stdlib.rglob("*.py") if not skip & set(p.relative_to(stdlib).parts))
    return [(p, p.relative_to(stdlib)) for i, p in enumerate(files) if i % HELD_OUT_EVERY == 0]


def functions(path: Path, at_most: int = 3) -> list[tuple[str, str]]:
    """(name, source) of the file's first functions or methods of a readable size."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            source = ast.get_source_segment(text, node)
            if source and 200 <= len(source) <= MAX_FUNCTION_CHARS:
                found.append((node.name, textwrap.dedent(" " * node.col_offset + source)))
        if len(found) == at_most:
            break
    return found


def main() -> None:
    turns, chars = [], 0
    for path, relative in held_out_files():
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        for name, source in functions(path):
            turns.append({"role": "user",
                          "content": f"How is `{name}` written in the `{module}` module?"})
            turns.append({"role": "assistant",
                          "content": f"Here is `{name}` from `{module}`:\n\n{source}\n"})
            chars += len(turns[-1]["content"]) + len(turns[-2]["content"])
        if chars >= TARGET_CHARS:
            break
    out = Path(__file__).resolve().parents[1] / "moeswap" / "bench" / "inputs" / "long_conversation.json"
    out.write_text(json.dumps({"source": "functions from held-out Python 3.11 stdlib files "
                                         "(PSF licence), written by scripts/make_bench_inputs.py",
                               "turns": turns}, indent=1) + "\n")
    print(f"{out}: {len(turns)} turns, {chars} characters")


if __name__ == "__main__":
    main()
