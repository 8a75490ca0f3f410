"""A legacy-split Mixtral-shaped file fails to load in llama.cpp before `moeswap fix`;
after it, it loads and computes the same logits as the stacked original."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_builders import mixtral, mixtral_legacy

from moeswap.cli import main

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (CI installs it; pip install "
                        "llama-cpp-python builds llama.cpp from source)")

pytestmark = pytest.mark.llama_cpp


def _load(path):
    return llama_cpp.Llama(model_path=str(path), vocab_only=False, n_ctx=32, verbose=False)


def _logits(path) -> np.ndarray:
    model = llama_cpp.Llama(model_path=str(path), n_ctx=32, verbose=False, logits_all=True)
    model.eval([1, 4, 5, 6])  # token ids: the toy vocabulary has no byte tokens to tokenize with
    logits = np.array(model.scores[:4])
    model.close()
    return logits


def test_legacy_split_loads_only_after_fix(tmp_path):
    legacy = mixtral_legacy().write(tmp_path / "legacy.gguf")
    with pytest.raises(Exception):  # llama.cpp: tensor 'blk.0.ffn_gate_exps.weight' not found
        _load(legacy)
    fixed = tmp_path / "fixed.gguf"
    assert main(["fix", str(legacy), "-o", str(fixed)]) == 0
    model = _load(fixed)
    assert model.n_vocab() == 32
    model.close()
    # the repaired experts are the original model's: llama.cpp computes identical logits
    reference = _logits(mixtral().write(tmp_path / "stacked.gguf"))
    repaired = _logits(fixed)
    assert np.isfinite(repaired).all()
    assert np.array_equal(repaired, reference)
