"""doctor held to llama.cpp: every file doctor calls clean loads and computes in llama.cpp, and
every broken fixture is refused by llama.cpp for the reason its rule gives.

Each file is loaded in a child process: llama.cpp aborts (GGML_ASSERT) on some limits instead of
raising, and an abort must fail one check, not the test run.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from gguf import GGUFValueType as T
from gguf_builders import LAYOUTS, MUTATIONS, mixtral
from split_builders import SPLIT_MUTATIONS

from moeswap.gguf_tools.doctor import diagnose

pytest.importorskip("llama_cpp", reason="llama-cpp-python is a dependency of moeswap")
pytestmark = pytest.mark.llama_cpp

# Loads the file, runs three tokens, prints LOADED and whether every logit is finite; a refusal
# raises ValueError, printed as REFUSED; an abort ends the process with SIGABRT.
CHILD = """
import sys, numpy, llama_cpp
try:
    model = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=32, verbose=True)
except ValueError:
    print("REFUSED")
    sys.exit(0)
model.eval([1, 4, 5])
print("LOADED", bool(numpy.isfinite(numpy.array(model.scores[:3])).all()))
"""

LOADS = "LOADED True"
# What llama.cpp says about each broken fixture: a fragment of its log. Where llama.cpp's first
# complaint is not the rule's own check, the comment says what it tripped on instead.
REFUSALS = {
    "not_gguf": "invalid magic characters: 'GGML'",
    "unsupported_version": "this GGUF file is version 7",
    "header_truncated": "failed to read key-value pairs",
    "header_corrupt": "number of key value pairs is 1152921504606846976",
    "duplicate_key": "duplicate key 'general.dup_a'",
    "duplicate_tensor": "duplicate tensor name 'blk.1.attn_q.weight'",
    "missing_architecture": "unknown model architecture: ''",
    "unknown_architecture": "unknown model architecture: 'mixtral'",
    "missing_required_key": "key not found in model: qwen3moe.embedding_length",
    "wrong_key_type_u64": "key qwen3moe.expert_count has wrong type u64 but expected type u32",
    "wrong_key_type_i32": "key deepseek2.leading_dense_block_count has wrong type i32",
    # without expert_count llama.cpp reads 0 experts and asserts top-k <= 0
    "missing_expert_count": "GGML_ASSERT(n_expert_used_max <= hparams.n_expert) failed",
    "missing_expert_used_count": "GGML_ASSERT(n_expert_used_max > 0) failed",
    # the width reads as 0, so the expert tensors' shapes are wrong
    "missing_expert_ff_length": "'blk.0.ffn_gate_up_exps.weight' has wrong shape",
    # the router's shape check comes before the 512-expert limit
    "expert_count_over_limit": "'blk.0.ffn_gate_inp.weight' has wrong shape",
    "expert_used_zero": "GGML_ASSERT(n_expert_used_max > 0) failed",
    "expert_used_gt_count": "GGML_ASSERT(n_expert_used_max <= hparams.n_expert) failed",
    "nonstandard_names": "tensor 'blk.0.ffn_gate_exps.weight' not found",
    "legacy_split": "tensor 'blk.0.ffn_down_exps.weight' not found",
    "mixed_expert_types": "tensor 'blk.0.ffn_down_exps.weight' not found",
    "missing_layer": "tensor 'blk.1.attn_norm.weight' not found",
    # without its router layer 1 is dense to llama.cpp: its expert tensors are left over
    "missing_router": "wrong number of tensors",
    "expert_shape_mismatch": "'blk.0.ffn_gate_exps.weight' has wrong shape",
    "unknown_tensor_type": "has invalid ggml type 200",
    "invalid_tensor_shape": "48 elements per row, not a multiple of block size",
    "misaligned_offset": "tensor 'token_embd.weight' has offset 4, expected 0",
    "tensor_data_past_eof": "data is not within the file bounds",
    "split_piece_missing": "failed to load GGUF split",
    "split_piece_mismatch": "invalid split file idx: 2",
    "split_duplicate_tensor": "tensor 'token_embd.weight' is duplicated",
    "split_tensor_count": "28 tensors expected but 27 found",
    # a warning, as the rule says: llama.cpp takes the first piece's value and runs
    "split_key_differs": LOADS,
}


def load_in_child(path) -> tuple[str, str]:
    """(what the child printed or 'ABORTED', llama.cpp's log)."""
    run = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                         text=True, timeout=120, env={"GGML_NO_BACKTRACE": "1", "PATH": ""})
    outcome = run.stdout.strip() or ("ABORTED" if run.returncode < 0 else f"exit {run.returncode}")
    return outcome, run.stderr


def load_all(paths) -> list[tuple[str, str]]:
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(load_in_child, paths))


def all_experts_used():
    """Mixtral's layout with top-k = expert count (4 of 4): legal for llama.cpp."""
    spec = mixtral()
    spec.kv[spec.key("expert_used_count")] = (4, T.UINT32)
    return spec


CLEAN = {**LAYOUTS, "all_experts_used": all_experts_used}


def test_expert_used_count_equal_to_expert_count_is_clean(tmp_path):
    report = diagnose(all_experts_used().write(tmp_path / "all.gguf"))
    assert report.findings == [] and report.exit_code == 0


def test_every_clean_fixture_loads_and_computes_in_llama_cpp(tmp_path):
    paths = [CLEAN[name]().write(tmp_path / f"{name}.gguf") for name in CLEAN]
    for name, path, (outcome, log) in zip(CLEAN, paths, load_all(paths)):
        assert diagnose(path).exit_code == 0, name
        assert outcome == LOADS, (name, outcome, log[-2000:])


def test_every_broken_fixture_is_refused_by_llama_cpp_as_its_rule_says(tmp_path):
    mutations = MUTATIONS + SPLIT_MUTATIONS
    assert {m.name for m in mutations} == set(REFUSALS)
    paths = [m.build(tmp_path) for m in mutations]
    for mutation, path, (outcome, log) in zip(mutations, paths, load_all(paths)):
        expected = REFUSALS[mutation.name]
        if expected == LOADS:  # only a warning may describe a file llama.cpp runs
            assert diagnose(path).exit_code == 1
            assert outcome == LOADS, (mutation.name, outcome, log[-2000:])
            continue
        assert outcome in ("REFUSED", "ABORTED"), (mutation.name, outcome, log[-2000:])
        assert expected in log, (mutation.name, log[-2000:])
