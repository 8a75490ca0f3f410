"""fix: repairs make doctor clean with every tensor byte unchanged; refusals write nothing."""

from __future__ import annotations

import hashlib

import pytest
from gguf import GGUFValueType as T
from gguf_builders import MUTATIONS, mixtral, qwen3moe

from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_moe import canonical_alias, split_expert
from moeswap.gguf_tools import fix
from moeswap.gguf_tools.doctor import diagnose

REPAIRABLE = [m for m in MUTATIONS if m.repairable]
REFUSED = [m for m in MUTATIONS if not m.repairable and m.name != "unknown_architecture"]


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _expected_tensor_bytes(src: GGUFFile) -> dict[str, bytes]:
    """Output name -> bytes, from the source: renamed as-is, split experts concatenated."""
    expected: dict[str, bytes] = {}
    for t in src.tensors:
        split = split_expert(t.name)
        name = (f"blk.{split.layer}.ffn_{split.part}_exps.weight" if split
                else canonical_alias(t.name) or t.name)
        expected.setdefault(name, b"")
        expected[name] += bytes(src.tensor_bytes(t))  # legacy experts come in expert order
    return expected


def _leftovers(directory, name: str) -> list:
    return [p.name for p in directory.iterdir() if p.name.startswith(f".{name}")]


@pytest.mark.parametrize("mutation", REPAIRABLE, ids=lambda m: m.name)
def test_fix_repairs_byte_exactly(mutation, tmp_path):
    path = mutation.build(tmp_path)
    before = _digest(path)
    out = tmp_path / "fixed.gguf"
    result = fix.fix_file(path, out, list(mutation.fix_sets))
    assert result.output == out and result.plan.actions
    assert _digest(path) == before  # the input is never touched
    assert diagnose(out).findings == []
    src, dst = GGUFFile.open(path), GGUFFile.open(out)
    expected = _expected_tensor_bytes(src)
    assert [t.name for t in dst.tensors] == list(expected)
    for t in dst.tensors:
        assert bytes(dst.tensor_bytes(t)) == expected[t.name], t.name
    # metadata records fix did not change are byte-identical
    changed = {a.split()[1] for a in result.plan.actions if a.startswith(("set", "retype", "add"))}
    for key, item in src.kv.items():
        if key not in changed:
            new = dst.kv[key]
            assert bytes(dst.buffer[new.start:new.end]) == bytes(src.buffer[item.start:item.end])
    assert _leftovers(tmp_path, "fixed.gguf") == []
    src.close()
    dst.close()


def test_legacy_split_fixed_equals_the_stacked_original(tmp_path):
    """Stacking legacy experts reproduces the canonical file's tensors exactly."""
    legacy = next(m for m in MUTATIONS if m.name == "legacy_split").build(tmp_path)
    fix.fix_file(legacy, tmp_path / "fixed.gguf")
    original = GGUFFile.open(mixtral().write(tmp_path / "original.gguf"))
    fixed = GGUFFile.open(tmp_path / "fixed.gguf")
    assert [(t.name, t.shape, t.type_id) for t in fixed.tensors] == \
        [(t.name, t.shape, t.type_id) for t in original.tensors]
    for t in original.tensors:
        assert bytes(fixed.tensor_bytes(fixed.tensor(t.name))) == bytes(original.tensor_bytes(t))
    original.close()
    fixed.close()


@pytest.mark.parametrize("mutation", REFUSED, ids=lambda m: m.name)
def test_unrepairable_files_are_refused(mutation, tmp_path):
    path = mutation.build(tmp_path)
    out = tmp_path / "fixed.gguf"
    with pytest.raises(MoeswapError) as error:
        fix.fix_file(path, out)
    message = str(error.value)
    assert str(path) in message
    if "nothing written" in message:  # header readable: the refusal names the rule(s)
        assert all(f"[{rule}]" in message for rule in mutation.expected - {"legacy-split-experts"})
    assert not out.exists() and _leftovers(tmp_path, "fixed.gguf") == []


def test_expert_used_count_is_never_guessed(tmp_path, capsys):
    path = next(m for m in MUTATIONS if m.name == "missing_expert_used_count").build(tmp_path)
    out = tmp_path / "fixed.gguf"
    assert main(["fix", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "[missing-expert-used-count] key qwen3moe.expert_used_count is missing" in err
    assert "no shape holds it" in err and err.count("\n") == 1
    assert not out.exists()


def test_nothing_to_repair_writes_nothing(tmp_path, capsys):
    path = next(m for m in MUTATIONS if m.name == "unknown_architecture").build(tmp_path)
    out = tmp_path / "fixed.gguf"
    assert main(["fix", str(path), "-o", str(out)]) == 0
    assert "nothing to repair" in capsys.readouterr().out and not out.exists()


def test_dry_run_writes_nothing(tmp_path, capsys):
    path = next(m for m in MUTATIONS if m.name == "legacy_split").build(tmp_path)
    out = tmp_path / "fixed.gguf"
    assert main(["fix", str(path), "-o", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "would stack 4 tensors 'blk.0.ffn_gate.0.weight'... into " \
           "'blk.0.ffn_gate_exps.weight' (F32, bytes copied)" in text
    assert not out.exists()
    path = next(m for m in MUTATIONS if m.name == "missing_router").build(tmp_path)
    assert main(["fix", str(path), "-o", str(out), "--dry-run"]) == 2
    assert "[missing-router]" in capsys.readouterr().out


@pytest.mark.parametrize("assignment, vtype, value", [
    ("qwen3moe.expert_used_count=4", T.UINT32, 4),          # llama.cpp's integer key: u32
    ("qwen3moe.expert_weights_scale=2.5", T.FLOAT32, 2.5),
    ("qwen3moe.expert_weights_norm=true", T.BOOL, True),
    ("general.name=Tiny Qwen", T.STRING, "Tiny Qwen"),
    ("tokenizer.ggml.bos_token_id=7", T.UINT32, 7),          # existing key keeps its type
    ("custom.count=3", T.UINT32, 3),                         # new key: typed by its text
    ("custom.big=-5", T.INT64, -5),
    ("custom.ratio=0.5", T.FLOAT32, 0.5),
])
def test_set_types(assignment, vtype, value, tmp_path):
    path = qwen3moe().write(tmp_path / "q.gguf")
    out = tmp_path / "out.gguf"
    fix.fix_file(path, out, [assignment])
    gf = GGUFFile.open(out)
    item = gf.kv[assignment.split("=")[0]]
    assert (item.type, item.value) == (vtype, value)
    gf.close()


@pytest.mark.parametrize("assignment", ["qwen3moe.expert_used_count=abc",
                                        "qwen3moe.expert_count=-1", "noequals",
                                        "tokenizer.ggml.tokens=x", "general.alignment=64"])
def test_bad_set_is_refused(assignment, tmp_path):
    path = qwen3moe().write(tmp_path / "q.gguf")
    with pytest.raises(MoeswapError):
        fix.fix_file(path, tmp_path / "out.gguf", [assignment])
    assert not (tmp_path / "out.gguf").exists()


def test_output_must_not_be_the_input(tmp_path, capsys):
    path = qwen3moe().write(tmp_path / "q.gguf")
    before = _digest(path)
    assert main(["fix", str(path), "-o", str(path), "--set", "general.name=x"]) == 2
    assert "never overwrites its input" in capsys.readouterr().err
    assert _digest(path) == before


def test_streams_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(fix, "CHUNK", 1000)
    path = next(m for m in MUTATIONS if m.name == "legacy_split").build(tmp_path)
    written = []
    fix.fix_file(path, tmp_path / "out.gguf", on_progress=written.append)
    assert max(written) == 1000 and sum(written) == sum(
        t.n_bytes for t in GGUFFile.open(path).tensors)
    assert diagnose(tmp_path / "out.gguf").findings == []


def test_failure_mid_write_leaves_no_output(tmp_path, monkeypatch):
    path = qwen3moe().write(tmp_path / "q.gguf")
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous contents")

    def failing_progress(n):
        raise OSError(28, "No space left on device")
    with pytest.raises(MoeswapError, match="No space left on device"):
        fix.fix_file(path, out, ["general.name=x"], on_progress=failing_progress)
    assert out.read_bytes() == b"previous contents"
    assert _leftovers(tmp_path, "out.gguf") == []
