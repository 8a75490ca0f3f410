"""`moeswap convert` against llama.cpp's own convert_hf_to_gguf.py on the same HF folders.

The reference script ships in the llama-cpp-python sdist (never committed here); point
MOESWAP_LLAMA_CPP_CONVERT at it (…/vendor/llama.cpp/convert_hf_to_gguf.py). Families whose
reference converter accepts a SentencePiece tokenizer are compared: every tensor's name,
shape, type and bytes, and every metadata key and value except the cosmetic ones.
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
    ours = convert(folder, tmp_path / "ours.gguf", out_type)
    a, b = GGUFReader(reference), GGUFReader(ours)
    meta_a = {k: f.contents() for k, f in a.fields.items() if not k.startswith("GGUF.")}
    meta_b = {k: f.contents() for k, f in b.fields.items() if not k.startswith("GGUF.")}
    assert set(meta_a) - COSMETIC_KEYS == set(meta_b) - COSMETIC_KEYS
    for key in set(meta_a) - COSMETIC_KEYS:
        assert meta_a[key] == meta_b[key], key
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert (list(x.shape), x.tensor_type) == (list(y.shape), y.tensor_type), x.name
        assert np.array_equal(x.data, y.data), x.name
