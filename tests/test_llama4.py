"""Llama 4, text part (GGUF arch llama4), on files written by llama.cpp's own convert_hf_to_gguf.py
(MOESWAP_LLAMA_CPP_CONVERT, as in tests/test_deepseek3.py).

The tiny Llama4ForCausalLM (tests/tiny_models.py, "llama4") has 4 layers: MoE at 1 and 3
(interleave_moe_layer_step 2) beside dense layers 0 and 2, 4 experts top-1 whose sigmoid weight
scales the expert's input, a shared expert, layer 3 without RoPE, chunks of 6 positions on the
RoPE layers and a temperature floor of 4 on the NoPE one, so that both act within the 16-token
prompt. The converter takes the text-only Llama4ForCausalLM folder as it is (no vision part
needed); its vocabulary reader wants Llama 4's BPE tokenizer, so these files take the tiny
SentencePiece one instead (test_convert_reference.SENTENCEPIECE_VOCAB).

The folder follows transformers' config. The GGUF follows llama.cpp, which writes none of the
chunk and temperature keys and hard-codes Scout's values (8192-position chunks, floor 8192,
scale 0.1): it is held to transformers run with those values, and to llama.cpp.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import tiny_models
from moeswap.formats.config import config_from_gguf, config_from_hf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models import load_model
from test_deepseek3 import (PROMPT, assert_matches_transformers, llama_cpp_logits, moeswap_logits,
                            reference_convert)
from tiny_models import relative_error

SCRIPT = os.environ.get("MOESWAP_LLAMA_CPP_CONVERT", "")
LONG = 8192 + 24  # past llama.cpp's temperature step (position 8191) and first chunk (8192)

pytestmark = pytest.mark.skipif(not Path(SCRIPT).is_file(), reason=(
    "set MOESWAP_LLAMA_CPP_CONVERT to llama.cpp's convert_hf_to_gguf.py (from the "
    "llama-cpp-python 0.3.36 sdist): these files come from the reference converter"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4")
    reference = tiny_models.save("llama4", root / "hf")
    return reference, root / "hf", {t: reference_convert(root / "hf", t) for t in ("f32", "q8_0")}


@pytest.fixture(scope="module")
def llama_cpp_reference():
    """The same weights in transformers, with llama.cpp's chunk and temperature constants."""
    return tiny_models.build("llama4_scout")


def test_the_files_carry_the_llama4_layout(files):
    _, hf_dir, paths = files
    for path in paths.values():
        config = config_from_gguf(GGUFFile.open(path))
        assert config.moe_layers == [1, 3] and config.n_moe_layer_step == 2
        assert (config.n_ff, config.n_ff_exp, config.n_ff_shexp) == (96, 32, 32)
        assert config.no_rope_layers == (False, False, False, True)
        assert config.swa_layers == (True, True, True, False) and config.chunked_attention
        assert (config.sliding_window, config.attn_temp_floor, config.attn_temp_scale) == (
            8192, 8192, 0.1)
        assert config.gating == "sigmoid" and not config.expert_weights_norm
        assert config.qk_l2_norm and not config.rope_neox
    folder = config_from_hf(hf_dir)
    assert (folder.sliding_window, folder.attn_temp_floor, folder.attn_temp_scale) == (6, 4, 0.5)
    assert folder.moe_layers == [1, 3] and folder.no_rope_layers == (False, False, False, True)
    # Llama 3 scaling: the converter's rope_freqs are the folder's factors (1, blended, 8 ...)
    from gguf import GGUFReader

    rope_freqs = next(t for t in GGUFReader(paths["f32"]).tensors if t.name == "rope_freqs.weight")
    factors = torch.tensor(folder.rope_factors)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0
    assert torch.allclose(torch.from_numpy(rope_freqs.data.copy()), factors.float())


def test_llama_cpp_reference_has_the_same_weights(files, llama_cpp_reference):
    reference, _, _ = files
    theirs = llama_cpp_reference.state_dict()
    assert all(torch.equal(w, theirs[name]) for name, w in reference.state_dict().items())


def test_the_tiny_config_makes_chunks_and_temperature_act(files):
    """In transformers: 8192-position chunks, or a floor of 8192, change the prompt's logits."""
    reference, _, _ = files
    ours = tiny_models.reference_logits(reference, PROMPT.tolist())
    for override in (dict(attention_chunk_size=8192), dict(floor_scale=8192)):
        other = tiny_models.reference_logits(tiny_models.build("llama4", **override),
                                             PROMPT.tolist())
        assert relative_error(other, ours) > 1e-2, override


def test_routing_weights_the_expert_input(files):
    """Weighting the experts' output instead (as other families do) changes the logits."""
    _, hf_dir, _ = files
    model = load_model(hf_dir)
    expected = model.forward([PROMPT], [model.new_cache()])[0]
    for i in model.config.moe_layers:
        model.layers[i].ffn.weight_input = False
    assert relative_error(model.forward([PROMPT], [model.new_cache()])[0], expected) > 1e-3


def test_folder_matches_transformers(files):
    reference, hf_dir, _ = files
    assert_matches_transformers(load_model(hf_dir), reference)


def test_conditional_generation_folder_runs_its_text_part(tmp_path):
    """Llama4ForConditionalGeneration, as Scout and Maverick are published: the language model
    under language_model., the vision tower and projector skipped. (transformers' own forward of
    the wrapper fails without an image here, so its language model is the reference.)"""
    import transformers as tf

    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                  projector_output_dim=64, pixel_shuffle_ratio=0.5)
    text = tiny_models.build("llama4").config.to_dict()
    torch.manual_seed(0)
    wrapper = tf.Llama4ForConditionalGeneration(
        tf.Llama4Config(text_config=text, vision_config=vision)).eval()
    wrapper.save_pretrained(tmp_path / "hf")
    tiny_models.save_tokenizer(tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    expected = tiny_models.reference_logits(wrapper.language_model, PROMPT.tolist())
    assert relative_error(model.forward([PROMPT], [model.new_cache()])[0], expected) <= 1e-4


def test_f32_gguf_matches_transformers_with_llama_cpps_constants(files, llama_cpp_reference):
    assert_matches_transformers(load_model(files[2]["f32"]), llama_cpp_reference)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_gguf_matches_llama_cpp(files, out_type):
    path = files[2][out_type]
    assert relative_error(moeswap_logits(path), llama_cpp_logits(path)) <= 1e-4


def test_trace_records_the_interleaved_layers_choices(files):
    """A routing trace holds MoE layers 1 and 3 only, each token's expert the one transformers'
    router picks (its largest logit), weighted by that logit's sigmoid."""
    from moeswap.routing.recorder import RoutingRecorder

    reference, hf_dir, _ = files
    recorder = RoutingRecorder()
    model = load_model(hf_dir, recorder=recorder)
    model.forward([PROMPT], [model.new_cache()])
    trace = recorder.trace(model="llama4", arch="llama4", layers=model.config.moe_layers,
                           n_experts=4, k=1, prompt_names=["p"])
    with torch.no_grad():
        logits = reference(PROMPT[None], output_router_logits=True).router_logits  # per MoE layer
    assert trace.layers.tolist() == [1, 3] and len(logits) == 2
    for column, layer_logits in enumerate(logits):
        assert trace.expert_ids[:, column, 0].tolist() == layer_logits.argmax(-1).tolist()
        expected = torch.sigmoid(layer_logits.max(-1).values)  # [T]
        assert torch.allclose(torch.from_numpy(trace.weights[:, column, 0]), expected, atol=1e-6)


@pytest.mark.llama_cpp
def test_gguf_chunks_and_temperature_follow_llama_cpp_past_8192(files):
    """llama.cpp's constants act from position 8191 on: the last 32 of 8216 positions give
    llama.cpp's logits on the f32 file (up to 5e-5 past the boundary, 2e-6 before it: RoPE
    angles in float64 against ggml's float32, docs/ARCHITECTURES.md). On the q8_0 file those
    differences, there before the boundary too, cross Q8_0 rounding steps (about 1e-2), so it is
    left to the 16-token check."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    path = files[2]["f32"]
    ids = torch.randint(0, tiny_models.VOCAB, (LONG,), generator=torch.Generator().manual_seed(2))
    model = load_model(path)
    cache = model.new_cache()
    for start in range(0, LONG - 32, 2048):
        model.forward([ids[start:min(start + 2048, LONG - 32)]], [cache], last_only=True)
    ours = model.forward([ids[LONG - 32:]], [cache])[0]  # [32, V]
    llm = llama_cpp.Llama(str(path), n_ctx=LONG + 64, n_batch=1024, n_ubatch=1024,
                          logits_all=True, type_k=0, type_v=0, flash_attn=False, n_threads=2,
                          verbose=False)
    llm.eval(ids.tolist())
    assert relative_error(ours, llm.scores[LONG - 32:LONG]) <= 1e-4


def test_convert_refuses_a_folder_llama_cpp_would_run_differently(files, tmp_path):
    """moeswap convert writes llama.cpp's file for llama4_scout (tests/test_convert_reference.py);
    the tiny folder's chunks and temperature are not what llama.cpp would run."""
    from moeswap.errors import MoeswapError
    from moeswap.gguf_tools.convert import convert

    with pytest.raises(MoeswapError, match="attention_chunk_size, attn_scale, floor_scale: not what"):
        convert(files[1], tmp_path / "x.gguf", "f32")


def test_run_refuses_a_file_it_cannot_run_in_one_line(files, tmp_path, capsys):
    from gguf_builders import replace_once
    from moeswap.cli import main

    path = tmp_path / "no_step.gguf"
    shutil.copy(files[2]["q8_0"], path)
    replace_once(path, b"llama4.interleave_moe_layer_step", b"llama4.interleave_moe_layer_stex")
    assert main(["run", str(path), "-p", "hi", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'llama4.interleave_moe_layer_step'" in err


def test_tools_and_store_know_the_family(files, capsys, monkeypatch):
    """doctor finds nothing, inspect sees the interleaved dense and MoE layers and the shared
    expert (a shared weight to the store and the planner), plan runs, and offload at one expert
    slot per layer gives the resident model's logits bit for bit."""
    from moeswap.experts.store import shared_bytes
    from moeswap.gguf_tools.doctor import diagnose
    from moeswap.gguf_tools.inspect import inspect_file
    from moeswap.cli import main
    from moeswap.planner.sizes import model_sizes
    from test_expert_store import assert_offload_equals_resident

    path = files[2]["q8_0"]
    assert diagnose(path).findings == []
    assert [row.kind for row in inspect_file(path).layers] == ["dense", "moe", "dense", "moe"]
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    assert main(["inspect", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1 / 4 / 1 (tensors)" in out and "sigmoid weights on the expert input (default)" in out
    assert main(["plan", str(path), "--host-mem", "1GiB", "-c", "256"]) == 0
    assert "(llama4)" in capsys.readouterr().out
    gguf = GGUFFile.open(path)
    routed = sum(t.n_bytes for t in gguf.tensors if "_exps." in t.name)
    assert shared_bytes(gguf, [1, 3]) == sum(t.n_bytes for t in gguf.tensors) - routed
    assert model_sizes(gguf).moe_layers == [1, 3]
    assert assert_offload_equals_resident(path) == [1, 3]
