"""Write tests/golden/default_model.json: llama.cpp's greedy continuation on the built-in model.

tests/test_default_model.py checks moeswap's greedy continuation against it token for token
(and asks llama.cpp again, live, where llama-cpp-python is installed).

    python scripts/make_default_golden.py
Needs: pip install llama-cpp-python==0.3.36
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import moeswap

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "default_model.json"
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
N_CONTINUATION = 32


def llama_cpp_greedy(path: Path, prompt: str, n: int) -> dict:
    """llama.cpp's prompt ids, its greedy continuation and each step's top1 - top2 margin."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, n_threads=1, seed=0,
                          verbose=False)
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    llm.eval(ids)
    tokens, margins = [], []
    for _ in range(n):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        second, first = np.partition(logits, -2)[-2:]
        tokens.append(int(np.argmax(logits)))
        margins.append(round(float(first - second), 4))
        llm.eval([tokens[-1]])
    return {"prompt": prompt, "prompt_ids": ids, "continuation_ids": tokens, "margins": margins}


def main() -> None:
    cases = [llama_cpp_greedy(moeswap.DEFAULT_MODEL, p, N_CONTINUATION) for p in PROMPTS]
    GOLDEN.write_text(json.dumps({"model_bytes": moeswap.DEFAULT_MODEL.stat().st_size,
                                  "cases": cases}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
