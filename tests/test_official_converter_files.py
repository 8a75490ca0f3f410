"""Files made by llama.cpp's own convert_hf_to_gguf.py, run as a new user would (issue 20).

Three supported families failed on them: Qwen2-MoE's shared-expert gate stored [1, n_embd],
Gemma 4's `tokenizer.ggml.model = "gemma4"` vocabulary, and GPT-OSS folders whose experts are
published as MXFP4 blocks. Each file is held to transformers (f32) and to llama.cpp (f32 and
q8_0) as the engine tests hold moeswap's own conversions. The reference script ships in the
llama-cpp-python sdist; point MOESWAP_LLAMA_CPP_CONVERT at it (see scripts/test.sh).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

import tiny_models
from gguf_builders import tensor_info_offset
from moeswap.cli import main
from moeswap.models import load_model

SCRIPT = os.environ.get("MOESWAP_LLAMA_CPP_CONVERT", "")
PROMPT = torch.randint(0, tiny_models.VOCAB, (16,), generator=torch.Generator().manual_seed(1))
# The tiny folders carry SentencePiece models; families whose reference reads a tokenizer.json
# run it with its own SentencePiece reader patched in for set_vocab, and nothing else.
SENTENCEPIECE_VOCAB = """
import importlib, runpy, sys
script, module, name = sys.argv[1:4]
sys.argv = [script, *sys.argv[4:]]
sys.path.insert(0, script.rsplit("/", 1)[0])
model = getattr(importlib.import_module("conversion." + module), name)
model.set_vocab = lambda self: self._set_vocab_sentencepiece()
runpy.run_path(script, run_name="__main__")
"""

pytestmark = pytest.mark.skipif(not Path(SCRIPT).is_file(), reason=(
    "set MOESWAP_LLAMA_CPP_CONVERT to llama.cpp's convert_hf_to_gguf.py (from the "
    "llama-cpp-python 0.3.36 sdist) to test the files it makes"))


def official_gguf(folder: Path, out: Path, out_type: str, sentencepiece: tuple[str, str] | None
                  = None) -> Path:
    """Convert ``folder`` with llama.cpp's converter; ``sentencepiece``: (module, class) whose
    set_vocab reads the folder's tokenizer.model."""
    if sentencepiece is None:
        command = [sys.executable, SCRIPT]
    else:
        wrapper = out.parent / "reference_with_sentencepiece.py"
        wrapper.write_text(SENTENCEPIECE_VOCAB)
        command = [sys.executable, str(wrapper), SCRIPT, *sentencepiece]
    subprocess.run([*command, str(folder), "--outtype", out_type, "--outfile", str(out)],
                   check=True, capture_output=True)
    return out


def logits(path) -> torch.Tensor:
    model = load_model(path)
    return model.forward([PROMPT], [model.new_cache()])[0]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def assert_matches_llama_cpp(path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    from test_llama_cpp_logits import llama_cpp_logits

    ours = logits(path).double().numpy()
    reference = llama_cpp_logits(path)
    assert float(np.abs(ours - reference).max() / np.abs(reference).max()) <= 1e-4, path.name


# --- Qwen2-MoE: ffn_gate_inp_shexp stored [1, n_embd] ----------------------------------------

@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2moe")
    reference = tiny_models.save("qwen2moe", folder / "hf")
    files = {t: official_gguf(folder / "hf", folder / f"model.{t}.gguf", t,
                              ("qwen", "Qwen2MoeModel")) for t in ("f32", "q8_0")}
    return reference, folder / "hf", files


def test_qwen2moe_official_file_matches_transformers(qwen2moe):
    reference, hf_dir, files = qwen2moe
    stored = {t.name: list(t.shape) for t in GGUFReader(files["f32"]).tensors}
    assert stored["blk.0.ffn_gate_inp_shexp.weight"] == [64, 1]  # ne: torch [1, n_embd]
    expected = tiny_models.reference_logits(reference, PROMPT.tolist())
    for source in (hf_dir, files["f32"]):
        assert relative_error(logits(source), expected) <= 1e-4, source


@pytest.mark.llama_cpp
@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_qwen2moe_official_file_matches_llama_cpp(qwen2moe, out_type):
    assert_matches_llama_cpp(qwen2moe[2][out_type])


def test_wrong_shexp_gate_shape_is_one_line_at_load(qwen2moe, tmp_path, capsys):
    """[2, 32] holds n_embd numbers too, but llama.cpp refuses it: so does moeswap, at load."""
    name = "blk.1.ffn_gate_inp_shexp.weight"
    data = bytearray(qwen2moe[2]["f32"].read_bytes())
    at = tensor_info_offset(bytes(data), name)
    struct.pack_into("<QQ", data, at + 4, 32, 2)  # ne (64, 1) -> (32, 2)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(data))
    assert main(["run", str(broken), "-p", "hello", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and "[2, 32]" in err[0], err
