"""doctor: exactly the expected rule ids for every broken file, and clean CLI errors."""

from __future__ import annotations

import json
import os
import re

import pytest
from corrupt_builders import CORRUPTIONS
from gguf_builders import LAYOUTS, MUTATIONS as SINGLE_MUTATIONS, qwen3moe
from split_builders import SPLIT_MUTATIONS

from moeswap.cli import main
from moeswap.gguf_tools.doctor import ERROR, RULES, RULES_BY_ID, WARNING, diagnose

MUTATIONS = SINGLE_MUTATIONS + SPLIT_MUTATIONS


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_clean_layouts(layout, tmp_path):
    report = diagnose(LAYOUTS[layout]().write(tmp_path / f"{layout}.gguf"))
    assert report.findings == [] and report.exit_code == 0


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_mutation_reports_exactly_its_rules(mutation, tmp_path):
    report = diagnose(mutation.build(tmp_path))
    assert set(report.rule_ids()) == mutation.expected
    for finding in report.findings:
        rule = RULES_BY_ID[finding.rule]
        assert finding.severity == rule.severity
        # the fix hint is the rule's, with {arch} filled in with the file's architecture
        pattern = re.escape(rule.fix).replace(re.escape("{arch}"), r"[\w-]+")
        assert re.fullmatch(pattern, finding.fix)
    severities = {RULES_BY_ID[r].severity for r in mutation.expected}
    assert report.exit_code == (2 if ERROR in severities else 1)


def test_catalogue_covers_every_rule():
    # corrupt_builders' damaged built-in models cover the rules llama.cpp does not refuse on
    covered = set().union(*(m.expected for m in MUTATIONS), *(c.rules for c in CORRUPTIONS))
    assert set(RULES_BY_ID) - covered == {"unreadable"}  # unreadable: see the CLI tests below
    assert len(RULES_BY_ID) == len(RULES)


def _messages(mutation_name: str, tmp_path) -> list[str]:
    mutation = next(m for m in MUTATIONS if m.name == mutation_name)
    return [f.message for f in diagnose(mutation.build(tmp_path)).findings]


def test_wrong_type_is_worded_like_llama_cpp(tmp_path):
    assert _messages("wrong_key_type_u64", tmp_path) == [
        "key qwen3moe.expert_count has wrong type u64 but expected type u32"]
    assert _messages("wrong_key_type_i32", tmp_path) == [
        "key deepseek2.leading_dense_block_count has wrong type i32 but expected type u32"]


def test_messages_name_the_key_or_tensor(tmp_path):
    assert _messages("expert_used_gt_count", tmp_path) == [
        "key deepseek2.expert_used_count = 9 exceeds deepseek2.expert_count = 8"]
    assert _messages("missing_router", tmp_path) == [
        "layer 1 has expert tensors but no router 'blk.1.ffn_gate_inp.weight'"]
    assert "tensor 'blk.0.ffn_gate_experts.weight' should be named " \
           "'blk.0.ffn_gate_exps.weight' for llama.cpp" in _messages("nonstandard_names", tmp_path)
    assert _messages("missing_layer", tmp_path) == [
        "no tensors for 1 layer(s): 1 (block_count = 3)"]
    assert "unknown to llama.cpp" in _messages("unknown_architecture", tmp_path)[0]


def test_unknown_architecture_is_a_warning(tmp_path):
    mutation = next(m for m in MUTATIONS if m.name == "unknown_architecture")
    assert RULES_BY_ID["unknown-architecture"].severity == WARNING
    assert main(["doctor", str(mutation.build(tmp_path))]) == 1


def test_cli_doctor_json_and_exit_codes(tmp_path, capsys):
    clean = qwen3moe().write(tmp_path / "clean.gguf")
    assert main(["doctor", str(clean)]) == 0
    assert "no problems found" in capsys.readouterr().out
    broken = next(m for m in MUTATIONS if m.name == "legacy_split").build(tmp_path)
    assert main(["doctor", str(broken), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 2
    assert {f["rule"] for f in data["findings"]} == {"legacy-split-experts"}


def _bad_inputs(tmp_path):
    good = qwen3moe().write(tmp_path / "good.gguf").read_bytes()
    files = {
        "not_gguf": b"PK\x03\x04 this is a zip, not a model" * 4,
        "truncated": good[:200],
        "random": os.urandom(4096),
        "empty": b"",
    }
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / f"{name}.gguf"
        paths[name].write_bytes(data)
    paths["directory"] = tmp_path
    paths["missing"] = tmp_path / "absent.gguf"
    return paths


@pytest.mark.parametrize("command", ["inspect", "doctor", "fix"])
def test_cli_bad_input_is_one_line(command, tmp_path, capsys):
    extra = ["-o", str(tmp_path / "out.gguf")] if command == "fix" else []
    for name, path in _bad_inputs(tmp_path).items():
        code = main([command, str(path), *extra])
        err = capsys.readouterr().err
        assert code == 2, name
        assert err.count("\n") == 1 and str(path) in err, (name, err)
        assert "Traceback" not in err


def test_cli_no_permission(tmp_path, capsys, monkeypatch):
    path = qwen3moe().write(tmp_path / "locked.gguf")
    path.chmod(0)
    if os.access(path, os.R_OK):  # running as root: make the open itself fail as it would
        import moeswap.formats.gguf_file as gguf_file

        def denied(*args, **kwargs):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(gguf_file, "open", denied, raising=False)
    for command in ("inspect", "doctor"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "permission denied" in err and str(path) in err
    assert diagnose(path).rule_ids() == ["unreadable"]
