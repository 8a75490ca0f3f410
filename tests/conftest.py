"""Fixtures more than one test module builds on."""

from __future__ import annotations

import pytest

import tiny_models
from moeswap.gguf_tools.convert import convert


@pytest.fixture(scope="module")
def deep_mixtral(tmp_path_factory):
    """Five MoE layers of eight experts: room for guesses up to four layers ahead."""
    folder = tmp_path_factory.mktemp("prefetch")
    tiny_models.save("mixtral", folder / "hf", num_local_experts=8, num_hidden_layers=5)
    return convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")
