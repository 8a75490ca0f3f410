"""GLM-4.5 / 4.6 (GGUF arch glm4moe) on files written by llama.cpp's own convert_hf_to_gguf.py
(MOESWAP_LLAMA_CPP_CONVERT, as in tests/test_deepseek3.py).

The tiny Glm4MoeForCausalLM (tests/tiny_models.py, "glm4moe") has a leading dense layer, 8
experts top-3 with sigmoid scores and a selection bias drawn wide enough to change the experts
chosen (asserted below), one shared expert, half-rotary heads, Q/K/V biases and q/k norms, and
one MTP layer counted in its config: without its tensors ("trunk-only": the GGUF's block_count
is 4, nextn_predict_layers 1) and, in the "mtp" twin, with them (blk.3.* and blk.3.nextn.*),
which llama.cpp and moeswap both leave out of the forward. The converter's GLM vocabulary
reader wants a real GLM tokenizer; these files take the tiny SentencePiece one instead
(test_convert_reference.SENTENCEPIECE_VOCAB); moeswap convert writes the same file
(tests/test_convert_reference.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tiny_models
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models import load_model
from test_deepseek3 import (assert_matches_transformers, llama_cpp_logits, moeswap_logits,
                            reference_convert, router_inputs)
from tiny_models import relative_error

SCRIPT = os.environ.get("MOESWAP_LLAMA_CPP_CONVERT", "")

pytestmark = pytest.mark.skipif(not Path(SCRIPT).is_file(), reason=(
    "set MOESWAP_LLAMA_CPP_CONVERT to llama.cpp's convert_hf_to_gguf.py (from the "
    "llama-cpp-python 0.3.36 sdist): these files come from the reference converter"))


def add_mtp_layer(folder: Path) -> None:
    """Layer 3 (= num_hidden_layers) as GLM-4.5 publishes its MTP module: a decoder layer (here
    layer 2's tensors) plus eh_proj, enorm, hnorm and shared_head.norm."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:
        tensors[name.replace("layers.2.", "layers.3.")] = tensors[name].clone()
    d = tiny_models.COMMON["hidden_size"]
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        tensors[f"model.layers.3.{name}"] = torch.ones(d)
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(
        d, 2 * d, generator=torch.Generator().manual_seed(3)) * 0.1
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["trunk_only", "mtp"])
def files(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"glm4moe_{request.param}")
    reference = tiny_models.save("glm4moe", root / "hf")
    if request.param == "mtp":
        add_mtp_layer(root / "hf")
    return (request.param, reference, root / "hf",
            {t: reference_convert(root / "hf", t) for t in ("f32", "q8_0")})


def test_the_files_carry_glm_routing_and_the_mtp_layer(files):
    variant, _, _, paths = files
    for path in paths.values():
        gguf = GGUFFile.open(path)
        assert gguf.get("glm4moe.block_count") == 4
        assert gguf.get("glm4moe.nextn_predict_layers") == 1
        assert (gguf.tensor("blk.3.nextn.eh_proj.weight") is not None) == (variant == "mtp")
        config = config_from_gguf(gguf)
        shape = (config.n_layer, config.n_layer_dense_lead, config.n_rot, config.head_dim)
        assert shape == (3, 1, 8, 16)
        assert config.gating == "sigmoid" and config.expert_weights_norm and config.rope_neox
        assert config.expert_weights_scale == 2.5
        assert gguf.tensor("blk.1.exp_probs_b.bias") is not None


@pytest.mark.parametrize("source", ["hf", "f32"])
def test_logits_and_greedy_continuation_match_transformers(files, source):
    _, reference, hf_dir, paths = files
    assert_matches_transformers(load_model(hf_dir if source == "hf" else paths["f32"]), reference)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_gguf_matches_llama_cpp(files, out_type):
    path = files[3][out_type]
    assert relative_error(moeswap_logits(path), llama_cpp_logits(path)) <= 1e-4


def test_selection_bias_changes_the_routing():
    """In transformers' own router, on the tiny model's real hidden states: dropping the
    selection bias changes the chosen experts of many tokens in every MoE layer."""
    model = tiny_models.build("glm4moe")
    inputs = router_inputs(model)
    assert sorted(inputs) == [1, 2]
    for i, h in inputs.items():
        gate = model.model.layers[i].mlp.gate
        with torch.no_grad():
            full = gate(h)[2].sort(dim=-1).values  # [N, K] expert ids
            gate.e_score_correction_bias.zero_()
            unbiased = gate(h)[2].sort(dim=-1).values
        assert (unbiased != full).any(dim=-1).float().mean() >= 0.25, i


def test_tools_and_store_know_the_family(files):
    """doctor finds nothing (a trunk-only file's absent MTP layer included), inspect sees the
    leading dense layer, exp_probs_b is a shared router weight, the planner's and the store's
    byte counts leave the MTP layer out (llama.cpp does not load it), and offload at one expert
    slot per layer gives the resident model's logits bit for bit."""
    from moeswap.experts.store import shared_bytes
    from moeswap.formats.gguf_moe import ROUTER, MoEView
    from moeswap.gguf_tools.doctor import diagnose
    from moeswap.gguf_tools.inspect import inspect_file
    from moeswap.planner.sizes import model_sizes
    from test_expert_store import assert_offload_equals_resident

    variant, _, _, paths = files
    path = paths["q8_0"]
    assert diagnose(path).findings == []
    kinds = [row.kind for row in inspect_file(path).layers]
    assert kinds == ["dense", "moe", "moe"] + (["moe"] if variant == "mtp" else [])
    gguf = GGUFFile.open(path)
    for layer in (1, 2):
        assert gguf.tensor(f"blk.{layer}.exp_probs_b.bias") in MoEView(gguf).layer(layer).of(ROUTER)
    run = [t for t in gguf.tensors if not t.name.startswith("blk.3.")]  # the MTP layer's left out
    routed = sum(t.n_bytes for t in run if "_exps." in t.name)
    assert shared_bytes(gguf, [1, 2]) == sum(t.n_bytes for t in run) - routed
    sizes = model_sizes(gguf)
    assert sizes.moe_layers == [1, 2] and sizes.total_bytes == sum(t.n_bytes for t in run)
    assert assert_offload_equals_resident(path) == [1, 2]
