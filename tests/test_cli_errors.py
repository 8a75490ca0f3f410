"""Bad combinations of a model and the run/trace options: one clear line, found before work."""

from __future__ import annotations

import pytest

from moeswap.cli import main
from moeswap.errors import MoeswapError


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    import tiny_models

    folder = tmp_path_factory.mktemp("hf") / "mixtral"
    tiny_models.save("mixtral", folder)
    return folder


@pytest.fixture(scope="module")
def dense_gguf(tmp_path_factory):
    import tiny_models
    from moeswap.gguf_tools.convert import convert

    folder = tmp_path_factory.mktemp("hf") / "gemma3"
    tiny_models.save("gemma3", folder)
    return convert(folder, folder.parent / "gemma3.gguf", "f32")


def test_offload_of_an_hf_folder_is_refused_with_the_convert_command(hf_mixtral, capsys):
    assert main(["run", str(hf_mixtral), "-p", "hi", "-n", "1", "--host-mem", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(hf_mixtral) in err
    assert "needs a .gguf file" in err and "moeswap convert" in err


def test_run_trace_of_a_dense_model_fails_before_generating(dense_gguf, tmp_path, capsys):
    out = tmp_path / "t.npz"
    assert main(["run", str(dense_gguf), "-p", "hello", "-n", "4", "--trace", str(out)]) == 2
    captured = capsys.readouterr()
    assert "no routed experts" in captured.err and "drop --trace" in captured.err
    assert captured.out == ""  # nothing was generated
    assert not out.exists()


def test_writing_a_trace_into_a_missing_folder_names_the_path(tmp_path):
    from moeswap.routing.importers import import_trace

    csv = tmp_path / "t.csv"
    csv.write_text("phase,n_tokens,layer,token_idx,e0,e1\nprefill,2,0,0,1,2\nprefill,2,0,1,2,3\n")
    trace = import_trace(csv)
    target = tmp_path / "missing" / "t.npz"
    with pytest.raises(MoeswapError, match=r"missing/t\.npz: cannot write the trace"):
        trace.save(target)
