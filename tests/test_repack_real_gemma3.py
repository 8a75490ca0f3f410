"""The real Gemma 3 270M (Q4_K_M; its Q4_K matrices repack on x86) with repacked shared
weights, as `moeswap run` loads it: llama.cpp's greedy tokens wherever its margin is clear,
the check the plain layouts pass in tests/test_real_gemma3.py."""

from __future__ import annotations

import pytest
from test_real_gemma3 import GOLDEN, clear_mismatches, gemma_package, teacher_forced_argmax

pytestmark = pytest.mark.real_model


def test_repacked_gemma3_keeps_llama_cpps_clear_greedy_tokens(tmp_path):
    import moeswap

    runtime = moeswap.load(gemma_package.assemble(), repack=True, tokenizer_cache_dir=tmp_path)
    for name, case in GOLDEN["prompts"].items():
        ours = teacher_forced_argmax(runtime, case["prompt_ids"], case["continuation_ids"])
        assert clear_mismatches(ours, case["continuation_ids"], case["margins"]) == [], name
