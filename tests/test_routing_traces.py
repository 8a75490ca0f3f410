"""Trace format, TraceBuilder and importers: tiny hand-made files, then the real traces
(tests/real_traces.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from real_traces import MIXTRAL, STDLIB_DOCS, SWITCH, needs_mixtral

from moeswap.errors import MoeswapError
from moeswap.routing.importers import import_trace
from moeswap.routing.traces import NO_EXPERT, RoutingTrace, TraceBuilder



def small_trace() -> RoutingTrace:
    b = TraceBuilder(model="tiny", arch="qwen3moe", layers=[1, 3], n_experts=4, k=2)
    b.begin_prompt("first")
    b.append(1, 0, [[0, 1], [2, 3]], [[0.6, 0.4], [0.5, 0.5]], router_probs=[[0.6, 0.4, 0, 0], [0, 0, 0.5, 0.5]],
             phase="prefill")
    b.append(3, 0, [[1, 2]], [[0.7, 0.3]], router_probs=[[0, 0.7, 0.3, 0]], phase="prefill")
    b.begin_prompt("second")
    b.append(3, 2, [[3, 0]], [[0.9, 0.1]], router_probs=[[0.1, 0, 0, 0.9]], phase="decode")
    return b.build()


def test_builder_places_tokens_and_marks_unrecorded_slots():
    t = small_trace()
    assert t.prompt_offsets.tolist() == [0, 2, 5]
    assert t.prompt_names == ["first", "second"]
    assert t.expert_ids.tolist() == [
        [[0, 1], [1, 2]],
        [[2, 3], [NO_EXPERT, NO_EXPERT]],
        [[NO_EXPERT] * 2, [NO_EXPERT] * 2],
        [[NO_EXPERT] * 2, [NO_EXPERT] * 2],
        [[NO_EXPERT] * 2, [3, 0]],
    ]
    assert t.valid.tolist() == [[True, True], [True, False], [False, False], [False, False], [False, True]]
    assert t.phase.tolist() == [0, 0, 0, 0, 1]
    assert t.router_probs.shape == (5, 2, 4) and float(t.router_probs[4, 1, 3]) == pytest.approx(0.9, abs=1e-3)
    assert np.isnan(t.weights[2]).all() and t.weights[0, 1].tolist() == pytest.approx([0.7, 0.3])


def test_save_load_round_trip_is_exact(tmp_path):
    t = small_trace()
    t.save(tmp_path / "t.npz")
    u = RoutingTrace.load(tmp_path / "t.npz")
    for name in ("layers", "prompt_offsets", "expert_ids", "phase"):
        assert np.array_equal(getattr(t, name), getattr(u, name)), name
    assert np.array_equal(t.weights, u.weights, equal_nan=True)
    assert np.array_equal(t.router_probs, u.router_probs, equal_nan=True)
    assert (u.model, u.arch, u.n_experts, u.k, u.prompt_names) == ("tiny", "qwen3moe", 4, 2, ["first", "second"])
    assert u.expert_ids.dtype == np.int16 and u.router_probs.dtype == np.float16


def test_select_prompts_keeps_their_tokens():
    t = small_trace().select_prompts([1])
    assert t.prompt_offsets.tolist() == [0, 3] and t.prompt_names == ["second"]
    assert t.expert_ids[2, 1].tolist() == [3, 0]


def test_load_errors_name_the_file_and_the_fix(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(MoeswapError, match=r"bad\.npz: not a moeswap trace .*import-trace"):
        RoutingTrace.load(bad)
    with pytest.raises(MoeswapError, match="no such trace file"):
        RoutingTrace.load(tmp_path / "missing.npz")


def test_inconsistent_arrays_are_refused():
    with pytest.raises(ValueError, match="expert ids must lie in"):
        RoutingTrace(model="m", arch="a", layers=[0], n_experts=2, k=1, prompt_offsets=[0, 1],
                     expert_ids=[[[2]]], weights=[[[1.0]]])


def test_jsonl_import_aligns_tokens_by_index(tmp_path):
    rows = [
        {"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 0], "gating_probs": [0.8, 0.2]},
        {"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [2, 1], "gating_probs": [0.6, 0.4]},
        {"dataset": "d", "problem_id": 0, "layer": 1, "token_idx": 0, "experts": [3, 2], "gating_probs": [0.5, 0.5]},
        {"dataset": "d", "problem_id": 7, "layer": 1, "token_idx": 0, "experts": [0, 3], "gating_probs": [0.9, 0.1]},
    ]
    src = tmp_path / "r.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = import_trace(src)
    assert (t.n_experts, t.k, t.layers.tolist(), t.prompt_names) == (4, 2, [0, 1], ["d-0", "d-7"])
    assert t.expert_ids.tolist() == [[[1, 0], [3, 2]], [[2, 1], [-1, -1]], [[-1, -1], [0, 3]]]
    assert t.weights[0, 0].tolist() == pytest.approx([0.8, 0.2])


def test_jsonl_bad_row_is_a_one_line_error(tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text('{"dataset": "d"}\n')
    with pytest.raises(MoeswapError, match=r"r\.jsonl:1: not a routing row"):
        import_trace(src)


def test_csv_import_splits_batches_and_prompts(tmp_path):
    src = tmp_path / "run.csv"
    src.write_text(
        "phase,n_tokens,layer,token_idx,e0,e1\n"
        "prefill,2,0,0,1,2\nprefill,2,0,1,3,0\nprefill,2,5,0,1,1\nprefill,2,5,1,2,2\n"  # prompt 0: tokens 0-1
        "decode,1,0,0,4,5\ndecode,1,5,0,6,7\n"  # token 2
        "decode,1,0,0,5,4\n"  # token 3 (layer 5 not recorded)
        "prefill,1,0,0,7,6\n"  # a new prompt
    )
    t = import_trace(src, model="m", arch="llama", n_experts=8)
    assert (t.model, t.arch, t.n_experts, t.k, t.layers.tolist()) == ("m", "llama", 8, 2, [0, 5])
    assert t.prompt_offsets.tolist() == [0, 4, 5]
    assert t.expert_ids[:, 0].tolist() == [[1, 2], [3, 0], [4, 5], [5, 4], [7, 6]]
    assert t.expert_ids[:, 1].tolist() == [[1, 1], [2, 2], [6, 7], [-1, -1], [-1, -1]]
    assert t.phase.tolist() == [0, 0, 1, 1, 0]


def test_csv_bad_header_names_the_expected_one(tmp_path):
    src = tmp_path / "x.csv"
    src.write_text("layer,token,e0\n0,0,1\n")
    with pytest.raises(MoeswapError, match="phase,n_tokens,layer,token_idx,e0"):
        import_trace(src)


@needs_mixtral
def test_real_mixtral_import_matches_the_readme():
    t = import_trace(MIXTRAL / "humaneval.jsonl")
    assert (t.n_layers, t.n_experts, t.k, t.n_prompts) == (32, 8, 2, 2)
    # README: 83 and 254 tokens at layer 0; a prompt is as long as its longest layer
    assert int(t.valid[:83, 0].sum()) == 83 and int(t.valid[83:, 0].sum()) == 254
    assert t.prompt_offsets.tolist() == [0, 83, 83 + 255]


def test_real_switch_import_uses_capture_metadata():
    t = import_trace(SWITCH)
    assert (t.model, t.n_tokens, t.k, t.n_experts) == ("google/switch-base-8", 215, 1, 8)
    assert t.layers.tolist() == [1, 3, 5, 7, 9, 11]
    assert t.n_prompts == 10 and t.prompt_names[0] == "security-01" and t.prompt_offsets[1] == 21
    assert t.valid.all()


def test_the_built_in_models_trace_matches_its_readme():
    t = RoutingTrace.load(STDLIB_DOCS)
    assert (t.model, t.arch, t.n_experts, t.k, t.n_tokens, t.n_prompts) == \
        ("stdlib-moe", "llama", 16, 2, 4599, 14)
    assert t.layers.tolist() == list(range(6)) and t.valid.all()
    assert t.prompt_names[0] == "README.md#0"
