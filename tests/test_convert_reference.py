"""`moeswap convert` against llama.cpp's own convert_hf_to_gguf.py on the same HF folders.

The reference script ships in the llama-cpp-python sdist (never committed here); point
MOESWAP_LLAMA_CPP_CONVERT at it (…/vendor/llama.cpp/convert_hf_to_gguf.py). Every tensor's
name, shape, type and bytes are compared, and every metadata key and value except the cosmetic
ones. DeepSeek-V2, GPT-OSS and Gemma 4 read their vocabulary from a tokenizer.json in the
reference (GPT-2 BPE, or Gemma 4's); the tiny folders carry SentencePiece models, so for them
the reference runs with its own SentencePiece reader (``set_vocab`` patched, nothing else).
For Gemma 4 that reader pads the vocabulary differently, so its tokenizer keys are left out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import tiny_models
from moeswap.gguf_tools.convert import convert

SCRIPT = os.environ.get("MOESWAP_LLAMA_CPP_CONVERT", "")
COSMETIC_KEYS = {"general.name", "general.size_label"}  # title-cased folder name, size estimate
SENTENCEPIECE_VOCAB = """
import runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, script.rsplit("/", 1)[0])
from conversion import deepseek, gemma, glm, gpt_oss, llama
for model in (deepseek.DeepseekV2Model, gpt_oss.GptOssModel, gemma.Gemma4Model, glm.Glm4MoeModel,
              llama.Llama4Model):
    model.set_vocab = lambda self: self._set_vocab_sentencepiece()
runpy.run_path(script, run_name="__main__")
"""

pytestmark = pytest.mark.skipif(not Path(SCRIPT).is_file(), reason=(
    "set MOESWAP_LLAMA_CPP_CONVERT to llama.cpp's convert_hf_to_gguf.py (from the "
    "llama-cpp-python 0.3.36 sdist) to compare against the reference converter"))


@pytest.mark.parametrize("family", ["mixtral", "granitemoe", "gemma3"])
@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_same_file_as_reference_converter(tmp_path, family, out_type):
    folder = tmp_path / "hf"
    tiny_models.save(family, folder)
    reference = tmp_path / "reference.gguf"
    subprocess.run([sys.executable, SCRIPT, str(folder), "--outtype", out_type,
                    "--outfile", str(reference)], check=True, capture_output=True)
    assert_same_file(reference, convert(folder, tmp_path / "ours.gguf", out_type))


@pytest.mark.parametrize(("family", "out_type"), [
    ("deepseek2", "f32"), ("deepseek2", "q8_0"), ("deepseek2_lite", "f32"), ("deepseek3", "f32"),
    ("deepseek3", "q8_0"), ("gpt_oss", "f32"),
    ("gpt_oss", "q8_0"), ("gemma4", "f32"), ("gemma4", "q8_0"), ("gemma4_multimodal", "f32"),
    ("glm4moe", "f32"), ("glm4moe", "q8_0"), ("llama4_scout", "f32"), ("llama4_scout", "q8_0")])
def test_same_tensors_as_reference_converter(tmp_path, family, out_type):
    folder = tmp_path / "hf"
    tiny_models.save(family, folder)
    wrapper = tmp_path / "reference_with_sentencepiece.py"
    wrapper.write_text(SENTENCEPIECE_VOCAB)
    reference = tmp_path / "reference.gguf"
    subprocess.run([sys.executable, str(wrapper), SCRIPT, str(folder), "--outtype", out_type,
                    "--outfile", str(reference)], check=True, capture_output=True)
    assert_same_file(reference, convert(folder, tmp_path / "ours.gguf", out_type),
                     skip_tokenizer=family.startswith("gemma4"))


def assert_same_file(reference, ours, skip_tokenizer: bool = False) -> None:
    a, b = GGUFReader(reference), GGUFReader(ours)
    skipped = ("GGUF.", "tokenizer.") if skip_tokenizer else ("GGUF.",)
    meta_a = {k: f.contents() for k, f in a.fields.items() if not k.startswith(skipped)}
    meta_b = {k: f.contents() for k, f in b.fields.items() if not k.startswith(skipped)}
    assert set(meta_a) - COSMETIC_KEYS == set(meta_b) - COSMETIC_KEYS
    for key in set(meta_a) - COSMETIC_KEYS:
        assert meta_a[key] == meta_b[key], key
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert (list(x.shape), x.tensor_type) == (list(y.shape), y.tensor_type), x.name
        assert np.array_equal(x.data, y.data), x.name
