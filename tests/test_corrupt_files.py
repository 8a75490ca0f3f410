"""Damaged copies of the built-in model (corrupt_builders.CORRUPTIONS): doctor reports each as
an error under its rule, and `run` refuses it in one line with exit 2 before computing
anything; --force skips the gate, and NaN logits then stop generation with an error."""

from __future__ import annotations

import pytest
from corrupt_builders import CORRUPTIONS, Corruption, read_built_in

from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.gguf_tools.doctor import ERROR, diagnose
from moeswap.models.loader import load_model


@pytest.fixture(scope="module")
def built_in():
    return read_built_in()


@pytest.fixture(scope="module")
def files(built_in, tmp_path_factory):
    directory = tmp_path_factory.mktemp("corrupt")
    return {c.name: c.build(directory, built_in) for c in CORRUPTIONS}


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=lambda c: c.name)
def test_doctor_reports_the_rule(corruption: Corruption, files):
    report = diagnose(files[corruption.name])
    found = {f.rule for f in report.findings if f.severity == ERROR}
    assert corruption.rules <= found, report.findings
    assert report.exit_code == 2


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=lambda c: c.name)
def test_run_refuses_in_one_line(corruption: Corruption, files, capsys):
    path = files[corruption.name]
    assert main(["run", str(path), "-p", "def", "-n", "2", "--temp", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moeswap: error: {path}: "), err
    assert "--force" in err[0]


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=lambda c: c.name)
def test_loader_refuses(corruption: Corruption, files):
    with pytest.raises(MoeswapError, match=str(files[corruption.name])):
        load_model(files[corruption.name])


def test_clean_built_in_model_passes(built_in, tmp_path):
    rewritten = Corruption("clean", frozenset()).build(tmp_path, built_in)
    assert diagnose(rewritten).findings == []


def test_force_runs_and_nan_logits_stop_generation(files, capsys):
    """--force loads a file with NaN in the final norm; the NaN logits end the reply with an
    error, not an empty one."""
    path = files["inf_in_norm"]
    assert main(["run", str(path), "-p", "def", "-n", "2", "--temp", "0", "--force"]) == 2
    err = capsys.readouterr().err
    assert "NaN or infinite logits" in err and "Traceback" not in err


def test_valid_per_layer_arrays_still_load(built_in, tmp_path, capsys):
    """Keys llama.cpp reads with get_key_or_arr may be one value per layer."""
    from corrupt_builders import A
    from gguf import GGUFValueType as T

    def per_layer(contents):
        for key, value in (("attention.head_count", 8), ("attention.head_count_kv", 4),
                           ("expert_used_count", 2), ("feed_forward_length", 256)):
            contents.kv[f"{A}.{key}"] = ([value] * 6, T.ARRAY, T.UINT32)

    path = Corruption("per_layer_arrays", frozenset(), edit=per_layer).build(tmp_path, built_in)
    assert diagnose(path).findings == []
    assert main(["run", str(path), "-p", "def", "-n", "2", "--temp", "0"]) == 0


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_refuse_before_planning(command, files, capsys):
    path = files["nan_in_router"]
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[non-finite-values]" in err[0], err
