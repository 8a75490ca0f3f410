"""Phi-3.5-MoE (GGUF arch phimoe) on files written by llama.cpp's own convert_hf_to_gguf.py
(MOESWAP_LLAMA_CPP_CONVERT, as in tests/test_deepseek3.py).

llama.cpp computes Phi-3.5-MoE differently from transformers, on purpose: RMS norm plus bias
where transformers takes LayerNorm, a renormalised softmax top-2 where transformers'
sparsemixer weighs each pick about 1, the converter's rope attn_factor where transformers takes
short_mscale, and LongRoPE's long factors once its context exceeds the original one, where
transformers always takes the short ones. So the HF folder is held to transformers and the
GGUF files to llama.cpp only (formats/families/phimoe.py, docs/ARCHITECTURES.md).

The tiny PhimoeForCausalLM has 8 experts top-2, Q/K/V/O and head biases, LayerNorm weights and
biases drawn away from 1 / 0, and a router jitter of 0.3, wide enough that sparsemixer's
weights are often below 1 (asserted below). Two LongRoPE shapes: "long" (original context 16,
64 positions: llama.cpp's context of 64, padded to 256, takes the long factors) and "short"
(original context 256, 1024 positions: the same context takes the short ones). Its config.json
names the class as microsoft/Phi-3.5-MoE-instruct does (PhiMoEForCausalLM), which the
converter wants. ``moeswap convert`` writes the converter's files, key for key and byte for byte.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

import tiny_models
from moeswap.formats.config import config_from_gguf, config_from_hf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models import load_model
from moeswap.models.moe import Router
from test_deepseek3 import (PROMPT, assert_matches_transformers, greedy, llama_cpp_logits,
                            reference_convert)
from tiny_models import relative_error

SCRIPT = os.environ.get("MOESWAP_LLAMA_CPP_CONVERT", "")
GGML_TYPE_F16 = 1  # llama.cpp's type_k / type_v for an f16 cache
CONTEXT = 64  # test_deepseek3.llama_cpp_logits' n_ctx (llama.cpp pads it to 256): moeswap's too
MSCALE = 1.3  # short_mscale = long_mscale, as Phi-3.5-MoE publishes them (equal)
# (original context, positions) of each LongRoPE shape
SHAPES = {"long": (16, 64), "short": (256, 1024)}

pytestmark = pytest.mark.skipif(not Path(SCRIPT).is_file(), reason=(
    "set MOESWAP_LLAMA_CPP_CONVERT to llama.cpp's convert_hf_to_gguf.py (from the "
    "llama-cpp-python 0.3.36 sdist): these files come from the reference converter"))


def build_phimoe(shape: str):
    """The tiny float32 PhimoeForCausalLM of that LongRoPE shape, in eval mode."""
    import transformers as tf

    original, positions = SHAPES[shape]
    pairs = tiny_models.COMMON["hidden_size"] // tiny_models.COMMON["num_attention_heads"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.2 * i for i in range(pairs)],
            "long_factor": [1.5 + 0.8 * i for i in range(pairs)],
            "short_mscale": MSCALE, "long_mscale": MSCALE}
    torch.manual_seed(0)
    config = tf.PhimoeConfig(**dict(
        tiny_models.COMMON, max_position_embeddings=positions, intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
        router_jitter_noise=0.3, rope_parameters=rope))
    model = tf.PhimoeForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1 / 0 and biases at 0: make all of them matter
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
    return model


def save_phimoe(shape: str, folder: Path):
    """build_phimoe's model saved to folder as the reference converter reads it; returns it."""
    reference = build_phimoe(shape)
    reference.save_pretrained(folder)
    tiny_models.save_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, architectures=["PhiMoEForCausalLM"])))
    return reference


@pytest.fixture(scope="module", params=list(SHAPES))
def files(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"phimoe_{request.param}") / "hf"
    reference = save_phimoe(request.param, folder)
    return (request.param, reference, folder,
            {t: reference_convert(folder, t) for t in ("f32", "q8_0")})


def logits(path, context: int = CONTEXT, kv_type: str = "f32") -> torch.Tensor:
    model = load_model(path, context_tokens=context, kv_type=kv_type)
    return model.forward([PROMPT], [model.new_cache()])[0]


def test_the_files_carry_phimoe_and_longrope(files):
    shape, _, folder, paths = files
    original, positions = SHAPES[shape]
    for path in paths.values():
        gguf = GGUFFile.open(path)
        config = config_from_gguf(gguf)
        assert (config.n_expert, config.n_expert_used, config.n_ff_exp, config.n_ff) == (8, 2, 32, 0)
        assert config.gating == "softmax" and config.expert_weights_norm and config.rope_neox
        assert not config.layer_norm and config.sliding_window == 0
        assert config.rope_orig_ctx == original
        # the converter's LongRoPE attn_factor, not the config's short_mscale
        expected = math.sqrt(1 + math.log(positions / original) / math.log(original))
        assert config.rope_mscale == pytest.approx(expected, rel=1e-6) != pytest.approx(MSCALE)
        for name in ("rope_factors_long.weight", "rope_factors_short.weight", "output.bias",
                     "blk.0.attn_norm.bias", "blk.1.ffn_norm.bias", "output_norm.bias"):
            assert gguf.tensor(name) is not None, name
    hf = config_from_hf(folder)
    assert hf.layer_norm and hf.gating == "sparsemixer" and not hf.expert_weights_norm
    assert hf.router_jitter == 0.3 and hf.rope_mscale == MSCALE and len(hf.rope_factors) == 8


def test_hf_folder_matches_transformers(files):
    _, reference, folder, _ = files
    assert_matches_transformers(load_model(folder), reference)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_gguf_matches_llama_cpp(files, out_type):
    path = files[3][out_type]
    assert relative_error(logits(path), llama_cpp_logits(path)) <= 1e-4


@pytest.mark.llama_cpp
def test_f16_kv_matches_llama_cpp_rounding_the_scaled_q(tmp_path, monkeypatch):
    """llama.cpp's Phi-3 graph scales q before attention (kq_scale 1), so an f16 cache rounds
    q * scale, which differs from scaling the rounded q unless the scale is a power of two. With
    heads 12 wide: 1.8e-4 when moeswap scaled the f16 dot products, 2.9e-5 now."""
    monkeypatch.setitem(tiny_models.COMMON, "hidden_size", 48)  # 4 heads of 12
    save_phimoe("long", tmp_path / "hf")
    path = reference_convert(tmp_path / "hf", "f32")
    reference = llama_cpp_logits(path, GGML_TYPE_F16)
    assert relative_error(logits(path, kv_type="f16"), reference) <= 1e-4


def test_the_gguf_takes_long_factors_beyond_the_original_context(files):
    """The context decides the factors, as llama.cpp's, after llama.cpp's padding to 256: the
    "long" file takes the long ones at any context (what llama.cpp ran above), the "short" file
    the short ones up to 256 positions and the long ones past it; without a context, the
    training context decides."""
    shape, _, _, paths = files
    path = paths["f32"]
    rope = load_model(path, context_tokens=CONTEXT).rope
    assert (rope.current is rope.long) == (shape == "long")
    if shape == "short":
        assert torch.equal(logits(path, 256), logits(path))
        assert relative_error(logits(path, 257), logits(path)) > 1e-2
    assert torch.equal(logits(path, 0), logits(path, SHAPES[shape][1]))


def router_inputs(model) -> dict[int, torch.Tensor]:
    """Each MoE layer's router input [N, D] on PROMPT, from transformers' own forward."""
    inputs = {}
    hooks = [layer.mlp.router.register_forward_hook(
        lambda router, args, out, i=i: inputs.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(model.model.layers)]
    tiny_models.reference_logits(model, PROMPT.tolist())
    for hook in hooks:
        hook.remove()
    return inputs


def test_sparsemixer_and_llama_cpp_routing_differ():
    """On the tiny model's real router inputs: moeswap's sparsemixer gives transformers' weights;
    they are often below 1, and far from llama.cpp's renormalised softmax over the same two
    experts. Whole models too: the GGUF's logits are far from transformers'."""
    model = build_phimoe("long")
    for i, h in router_inputs(model).items():
        router = model.model.layers[i].mlp.router
        with torch.no_grad():
            _, weights, ids = router(h)  # [N, 2], [N, 2]
        ours = Router(router.weight, 2, False, gating="sparsemixer", jitter_eps=0.3)
        our_ids, our_weights = ours(h)
        assert torch.equal(our_ids, ids) and torch.allclose(our_weights, weights, atol=1e-6)
        assert (weights < 0.99).any(dim=-1).float().mean() >= 0.25, i
        llama_ids, llama_weights = Router(router.weight, 2, True)(h)
        assert torch.equal(llama_ids, ids)  # the same experts, weighed differently
        assert (llama_weights - weights).abs().max(dim=-1).values.mean() >= 0.2, i


def test_gguf_and_transformers_differ_by_design(files):
    _, reference, _, paths = files
    expected = tiny_models.reference_logits(reference, PROMPT.tolist())
    assert relative_error(logits(paths["f32"]), expected) > 0.05


def test_tools_and_store_know_the_family(files):
    """doctor finds nothing (phimoe's experts are feed_forward_length wide, as in llama.cpp),
    inspect and the planner see two MoE layers and their expert widths, the rope factors and
    biases are shared weights, and offload at one expert slot per layer gives the resident
    model's logits bit for bit and its greedy tokens."""
    from moeswap.experts.store import shared_bytes
    from moeswap.gguf_tools.doctor import diagnose
    from moeswap.gguf_tools.inspect import inspect_file
    from moeswap.models.quant_experts import QuantResidentExperts
    from moeswap.planner.sizes import model_sizes
    from test_expert_store import decode_logits, plan, store_model

    path = files[3]["q8_0"]
    assert diagnose(path).findings == []
    assert [row.kind for row in inspect_file(path).layers] == ["moe", "moe"]
    gguf = GGUFFile.open(path)
    routed = sum(t.n_bytes for t in gguf.tensors if "_exps." in t.name)
    assert shared_bytes(gguf, [0, 1]) == sum(t.n_bytes for t in gguf.tensors) - routed
    sizes = model_sizes(gguf)
    assert sizes.moe_layers == [0, 1] and sizes.routed_bytes == routed
    resident_model = load_model(path, threads=1, expert_runner=QuantResidentExperts)
    resident = decode_logits(resident_model)
    _, _, layers, _ = plan(path)
    model, factory = store_model(path, len(layers))
    assert torch.equal(decode_logits(model), resident)
    assert factory.stats()["total"]["disk_misses"] > 0

    def next_logits(model):
        return lambda ids: model.forward([torch.tensor(ids)], [model.new_cache()])[0][-1]

    start = PROMPT.tolist()
    assert greedy(next_logits(model), start, 6) == greedy(next_logits(resident_model), start, 6)


@pytest.mark.parametrize(("name", "ne", "shown"), [
    ("rope_factors_long.weight", (4,), "expected [8]"),
    ("blk.1.ffn_norm.bias", (32,), "expected [64]")])
def test_a_file_moeswap_cannot_run_is_one_line(files, tmp_path, capsys, name, ne, shown):
    """Not a torch traceback from the middle of a forward: the tensor's name, exit 2; with
    --force too (past the file checks: the family's own shape checks)."""
    from moeswap.cli import main
    from test_official_converter_files import tensor_info_offset

    data = bytearray(files[3]["f32"].read_bytes())
    struct.pack_into("<" + "Q" * len(ne), data, tensor_info_offset(bytes(data), name) + 4, *ne)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(data))
    assert main(["run", str(broken), "--force", "-p", "hello", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{name}'" in err[0] and shown in err[0], err


def test_a_folder_whose_mscales_differ_is_one_line(files, tmp_path, capsys):
    """transformers would switch mscale per forward; moeswap refuses it by name, exit 2."""
    from moeswap.cli import main

    folder = tmp_path / "hf"
    shutil.copytree(files[2], folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["long_mscale"] = 1.1
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["run", str(folder), "-p", "hello", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "long_mscale 1.1" in err[0], err


@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_moeswap_convert_writes_the_reference_file(files, out_type, tmp_path):
    from moeswap.gguf_tools.convert import convert
    from test_convert_reference import assert_same_file

    _, _, folder, paths = files
    assert_same_file(paths[out_type], convert(folder, tmp_path / "ours.gguf", out_type))
