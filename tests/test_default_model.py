"""The built-in model as shipped: a valid file within the size limit, llama.cpp's tokens.

The golden file holds llama.cpp's greedy continuations of the shipped GGUF
(scripts/make_default_golden.py), so the check runs without llama-cpp-python; where it is
installed, the llama_cpp-marked test asks llama.cpp again, live.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import moeswap
from moeswap.gguf_tools import doctor

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = json.loads((ROOT / "tests" / "golden" / "default_model.json").read_text("utf-8"))


@pytest.fixture(scope="module")
def runtime():
    return moeswap.load(moeswap.DEFAULT_MODEL, threads=1)


def test_shipped_file_is_a_clean_moe_gguf_under_40_mb():
    size = moeswap.DEFAULT_MODEL.stat().st_size
    assert size <= 40 * 2**20
    assert size == GOLDEN["model_bytes"], "the golden file belongs to another build of the model"
    report = doctor.diagnose(moeswap.DEFAULT_MODEL)
    assert report.findings == []


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["prompt"][:12])
def test_greedy_continuation_equals_llama_cpp_token_for_token(runtime, case):
    assert runtime.encode(case["prompt"]) == case["prompt_ids"]
    tokens = list(runtime.generate(case["prompt"], max_tokens=len(case["continuation_ids"]),
                                   temperature=0, stop_ids=frozenset()))
    assert tokens == case["continuation_ids"]


@pytest.mark.llama_cpp
def test_golden_file_is_what_llama_cpp_says_now():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the peer that wrote the golden file")
    spec = importlib.util.spec_from_file_location("make_default_golden",
                                                  ROOT / "scripts" / "make_default_golden.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for case in GOLDEN["cases"]:
        live = script.llama_cpp_greedy(moeswap.DEFAULT_MODEL, case["prompt"],
                                       len(case["continuation_ids"]))
        assert live["prompt_ids"] == case["prompt_ids"]
        assert live["continuation_ids"] == case["continuation_ids"]
