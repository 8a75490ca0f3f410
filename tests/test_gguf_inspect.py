"""inspect and the MoE view: roles, metadata and byte totals on the four tiny layouts."""

from __future__ import annotations

import json

import pytest
from gguf_builders import D, F, LAYOUTS, V, deepseek2, gemma4, mixtral, mixtral_legacy, qwen3moe

from moeswap.cli import main
from moeswap.formats import gguf_file
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_moe import (
    ATTENTION, DENSE_FFN, EMBEDDING, NORM, OTHER, OUTPUT, ROUTED, ROUTER, SHARED_EXPERT,
    MoEView, TensorRole, canonical_alias, classify, expert_byte_span, split_expert,
)
from moeswap.gguf_tools.inspect import inspect_file

F32_BYTES = 4
Q8_0_BLOCK = 34  # bytes per 32 values


@pytest.mark.parametrize("name, role", [
    ("blk.3.ffn_gate_inp.weight", TensorRole(ROUTER, 3, None, "weight")),
    ("blk.3.ffn_gate_inp.bias", TensorRole(ROUTER, 3, None, "bias")),        # gpt-oss
    ("blk.3.ffn_gate_inp.scale", TensorRole(ROUTER, 3, None, "scale")),      # gemma4
    ("blk.3.exp_probs_b.bias", TensorRole(ROUTER, 3, None, "bias")),
    ("blk.3.ffn_up_exps.bias", TensorRole(ROUTED, 3, "up", "bias")),         # gpt-oss
    ("blk.3.ffn_down_exps.scale", TensorRole(ROUTED, 3, "down", "scale")),   # gemma4
    ("blk.3.ffn_gate_up_exps.weight", TensorRole(ROUTED, 3, "gate_up", "weight")),
    ("blk.3.ffn_gate_experts.weight", TensorRole(ROUTED, 3, "gate", "weight")),
    ("blk.3.ffn_down_moe.weight", TensorRole(ROUTED, 3, "down", "weight")),
    ("blk.3.ffn_up.7.weight", TensorRole(ROUTED, 3, "up", "weight")),        # legacy split
    ("blk.3.ffn_expert_07.down.weight", TensorRole(ROUTED, 3, "down", "weight")),
    ("blk.3.ffn_up_shexp.weight", TensorRole(SHARED_EXPERT, 3, "up", "weight")),
    ("blk.3.ffn_gate_inp_shexp.weight", TensorRole(SHARED_EXPERT, 3, None, "weight")),
    ("blk.3.ffn_up.weight", TensorRole(DENSE_FFN, 3, "up", "weight")),
    ("blk.3.attn_sinks.weight", TensorRole(ATTENTION, 3, None, "weight")),
    ("blk.3.attn_kv_a_mqa.weight", TensorRole(ATTENTION, 3, None, "weight")),
    ("blk.3.attn_q_norm.weight", TensorRole(NORM, 3, None, "weight")),
    ("blk.3.post_ffw_norm_2.weight", TensorRole(NORM, 3, None, "weight")),
    ("token_embd.weight", TensorRole(EMBEDDING)),
    ("output.weight", TensorRole(OUTPUT)),
    ("output_norm.weight", TensorRole(NORM)),
    ("rope_freqs.weight", TensorRole(OTHER)),
])
def test_classify_names(name, role):
    assert classify(name) == role


def test_alias_and_split_tables():
    assert canonical_alias("blk.0.ffn_up_experts.weight") == "blk.0.ffn_up_exps.weight"
    assert canonical_alias("blk.12.ffn_down_moe.weight") == "blk.12.ffn_down_exps.weight"
    assert canonical_alias("blk.0.ffn_up_exps.weight") is None
    assert split_expert("blk.2.ffn_gate.5.weight").expert == 5
    assert split_expert("blk.2.ffn_gate_expert_05.weight").expert == 5
    assert split_expert("blk.2.ffn_gate_exps.weight") is None


def _bytes_q8(n_values: int) -> int:
    return n_values // 32 * Q8_0_BLOCK


def test_mixtral_totals_exact(tmp_path):
    report = inspect_file(mixtral().write(tmp_path / "m.gguf"))
    m = report.metadata
    assert (m.architecture, m.block_count, m.n_embd, m.expert_count, m.expert_used_count) == \
        ("llama", 2, D, 4, 2)
    assert report.is_moe and report.expert_width == F
    assert [row.kind for row in report.layers] == ["moe", "moe"]
    one_expert = 3 * D * F * F32_BYTES
    routed = 2 * 4 * one_expert
    total = sum(t.bytes for t in report.tensors)
    embd = D * V * F32_BYTES
    assert report.totals.routed == routed
    assert report.totals.shared == total - routed
    assert report.totals.one_expert == one_expert
    # untied output: one embedding row is read per token, plus top-2 experts in both layers
    assert report.totals.active_per_token == total - routed - embd + D * F32_BYTES \
        + 2 * 2 * one_expert
    assert report.type_mix == {"F32": (len(report.tensors), total)}


def test_legacy_split_counts_as_routed(tmp_path):
    stacked = inspect_file(mixtral().write(tmp_path / "m.gguf"))
    legacy = inspect_file(mixtral_legacy().write(tmp_path / "l.gguf"))
    assert legacy.totals == stacked.totals
    assert legacy.expert_width == F


def test_qwen3moe_types_and_roles(tmp_path):
    report = inspect_file(qwen3moe().write(tmp_path / "q.gguf"))
    expert_bytes = _bytes_q8(D * F * 8)
    assert report.type_mix["Q8_0"] == (6, 2 * 3 * expert_bytes)
    layer = report.layers[0]
    assert layer.types_by_role == {ROUTER: ["F32"], ROUTED: ["Q8_0"], ATTENTION: ["F32"],
                                   NORM: ["F32"]}
    assert layer.bytes_by_role[ROUTED] == 3 * expert_bytes
    assert layer.one_expert_bytes == 3 * expert_bytes // 8


def test_deepseek2_dense_first_layer_and_shared_experts(tmp_path):
    report = inspect_file(deepseek2().write(tmp_path / "d.gguf"))
    m = report.metadata
    assert [row.kind for row in report.layers] == ["dense", "moe", "moe"]
    assert (m.expert_shared_count, m.leading_dense_block_count) == (2, 1)
    assert (m.gating_func_name, m.expert_weights_scale, m.expert_weights_norm) == \
        ("sigmoid", 2.5, True)
    assert report.layers[0].bytes_by_role[DENSE_FFN] == 3 * D * 96 * F32_BYTES
    assert report.layers[1].bytes_by_role[SHARED_EXPERT] == 3 * D * 2 * F * F32_BYTES
    assert report.layers[1].bytes_by_role[ROUTER] == (D * 8 + 8) * F32_BYTES  # + exp_probs_b


def test_gemma4_fused_experts_scales_and_tied_output(tmp_path):
    gf = GGUFFile.open(gemma4().write(tmp_path / "g.gguf"))
    view = MoEView(gf)
    layer = view.layer(1)
    assert {t.name for t in layer.of(ROUTED)} == {
        "blk.1.ffn_gate_up_exps.weight", "blk.1.ffn_down_exps.weight", "blk.1.ffn_down_exps.scale"}
    assert {t.name for t in layer.of(ROUTER)} == {"blk.1.ffn_gate_inp.weight",
                                                  "blk.1.ffn_gate_inp.scale"}
    assert layer.of(DENSE_FFN) and view.expert_width == F
    totals = view.totals()
    one_expert = _bytes_q8(D * 2 * F) + _bytes_q8(F * D) + F32_BYTES
    assert totals.one_expert == one_expert
    # tied output: the whole token_embd is read for the logits
    assert totals.active_per_token == totals.shared + 2 * 2 * one_expert
    gf.close()


def test_expert_byte_span_addresses_one_expert(tmp_path):
    spec = qwen3moe()
    gf = GGUFFile.open(spec.write(tmp_path / "q.gguf"))
    info = gf.tensor("blk.1.ffn_down_exps.weight")
    start, length = expert_byte_span(info, 5, 8)
    source = next(t for t in spec.tensors if t.name == info.name).data
    assert bytes(gf.buffer[start:start + length]) == source[5 * length:6 * length]
    gf.close()


def test_gemma3_like_dense_file_is_not_moe(tmp_path):
    spec = deepseek2()
    spec.drop_tensors(lambda n: not n.startswith(("blk.0.", "token_embd", "output")))
    spec.kv[spec.key("block_count")] = (1, spec.kv[spec.key("block_count")][1])
    for key in ("expert_count", "expert_used_count"):
        del spec.kv[spec.key(key)]
    report = inspect_file(spec.write(tmp_path / "dense.gguf"))
    assert not report.is_moe and report.totals.routed == 0


def test_inspect_never_decodes_tokenizer_arrays(tmp_path, monkeypatch):
    path = qwen3moe().write(tmp_path / "q.gguf")

    def refuse(self):
        raise AssertionError("inspect decoded a string array")
    monkeypatch.setattr(gguf_file.StringArray, "__iter__", refuse)
    assert main(["inspect", str(path), "--tensors"]) == 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cli_inspect_json(layout, tmp_path, capsys):
    path = LAYOUTS[layout]().write(tmp_path / f"{layout}.gguf")
    assert main(["inspect", str(path), "--json", "--tensors"]) == 0
    data = json.loads(capsys.readouterr().out)
    gf = GGUFFile.open(path)
    assert [t["name"] for t in data["tensors"]] == [t.name for t in gf.tensors]
    assert data["metadata"]["architecture"] == ("llama" if layout == "mixtral" else layout)
    assert data["is_moe"] is True
    assert data["totals"]["total"] == sum(t.n_bytes for t in gf.tensors)
    gf.close()


def test_cli_inspect_tables(tmp_path, capsys):
    path = deepseek2().write(tmp_path / "d.gguf")
    assert main(["inspect", str(path), "--tensors"]) == 0
    out = capsys.readouterr().out
    for text in ("deepseek2 (known to llama.cpp)", "2 / 8 / 2", "sigmoid", "Q8_0",
                 "blk.2.ffn_down_shexp.weight", "shared_expert"):
        assert text in out


def test_cli_inspect_names_llama_cpp_defaults_for_absent_gating_keys(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line, whatever the terminal
    path = mixtral().write(tmp_path / "m.gguf")  # Mixtral files carry no gating keys
    assert main(["inspect", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "softmax (default)" in out and "weights norm True (default)" in out
    path = deepseek2().write(tmp_path / "d.gguf")  # keys present: shown as stored
    assert main(["inspect", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "sigmoid, weights norm True," in out and "(default)" not in out
