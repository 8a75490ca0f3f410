"""Attention graphs of layers outside ggml_attention.LayerGraph (moeswap.models.sequence_graph):
MLA (DeepSeek-V2/V3, moeswap.models.mla_graph) and Gemma 4's (moeswap.models.gemma4_graph),
against llama.cpp and against the torch reference (the attention's own code,
load_model(graphs=False)).

The MLA graph mirrors llama.cpp's deepseek2 graph with MLA absorbed (latent rows as the only
cached keys, values read from them) and its attention without flash attention, so Q8_0 files
give llama.cpp's logits bit for bit with an f32 and an f16 cache: with and without query
compression (deepseek2 / deepseek2_lite) and with V3's routing, all with YaRN RoPE. Gemma 4's
graph is its whole layer where the FFN can join: its Q8_0 and f32 files give llama.cpp's
logits bit for bit up to the final soft-cap, whose tanh is torch's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_models
from moeswap.errors import MoeswapError
from moeswap.gguf_tools.convert import convert
from moeswap.models import load_model
from moeswap.models.gemma4_graph import Gemma4AttentionGraph
from moeswap.models.mla_graph import MlaLayerGraph
from moeswap.quant.ggml_lib import InitParams
from moeswap.quant.graph_arena import Arena

PROMPT = torch.randint(0, tiny_models.VOCAB, (40,), generator=torch.Generator().manual_seed(3))
GRAPHS = {"deepseek2": MlaLayerGraph, "deepseek2_lite": MlaLayerGraph,
          "deepseek3": MlaLayerGraph, "gemma4": Gemma4AttentionGraph}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """(family, type) -> its tiny model as a GGUF of that type (made on first use)."""
    made = {}

    def file(family: str, kind: str = "q8_0"):
        if (family, kind) not in made:
            folder = tmp_path_factory.mktemp(family)
            tiny_models.save(family, folder / "hf")
            made[family, kind] = convert(folder / "hf", folder / f"model.{kind}.gguf", kind)
        return made[family, kind]
    return file


def logits(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    return model.forward([ids], [cache if cache is not None else model.new_cache()])[0]


# (deepseek3's steps part from its whole forward on the torch path too, by 4.7e-2 from the
# third token on: outside the attention, which this checks.)
@pytest.mark.parametrize("family", ["deepseek2", "deepseek2_lite", "gemma4"])
def test_every_layer_gets_a_graph_and_steps_equal_the_whole_forward(gguf_files, family):
    """Also past Gemma 4's 4-position windows (a ring)."""
    model = load_model(gguf_files(family), kv_type="f16")
    assert all(isinstance(layer.graph, GRAPHS[family]) for layer in model.layers)
    whole = logits(model, PROMPT)
    cache = model.new_cache()
    steps = torch.cat([logits(model, PROMPT[i:i + 1], cache) for i in range(len(PROMPT))])
    assert torch.equal(steps, whole)
    reference = load_model(gguf_files(family), kv_type="f16", graphs=False)
    assert all(layer.graph is None for layer in reference.layers)
    if family.startswith("deepseek"):
        # An f16 rounding that lands the other way moves the Q8_0-quantized activations after
        # it by a whole step: up to 4.8e-2 (26-layer deepseek2_lite); the same tokens win.
        assert tiny_models.relative_error(whole, logits(reference, PROMPT)) < 6e-2
        assert torch.equal(whole.argmax(-1), logits(reference, PROMPT).argmax(-1))


@pytest.mark.parametrize("family", ["deepseek2", "gemma4"])
@pytest.mark.parametrize("kv_type, bound", [("f32", 1e-5), ("f16", 1e-3)])
def test_the_f32_file_agrees_with_the_torch_path(gguf_files, family, kv_type, bound):
    """Float weights (bound, not copied): the two paths differ by the products' summation
    order, and with an f16 cache by the f16 roundings that order flips (deepseek2: 8.6e-7,
    2.9e-5; gemma4: 4.2e-6, 6e-4, where ggml's f16-table GELU amplifies them)."""
    path = gguf_files(family, "f32")
    graph = load_model(path, kv_type=kv_type)
    assert all(isinstance(layer.graph, GRAPHS[family]) for layer in graph.layers)
    reference = logits(load_model(path, kv_type=kv_type, graphs=False), PROMPT)
    assert tiny_models.relative_error(logits(graph, PROMPT), reference) < bound


@pytest.mark.llama_cpp
@pytest.mark.parametrize("family", ["deepseek2", "deepseek2_lite", "deepseek3"])
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_q8_0_logits_equal_llama_cpps_bit_for_bit(gguf_files, family, kv_type):
    pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    path = gguf_files(family)
    reference = tiny_models.llama_cpp_scores(path, PROMPT, {"f32": 0, "f16": 1}[kv_type])
    tiny_models.assert_same_bits(logits(load_model(path, kv_type=kv_type), PROMPT).numpy(),
                                 reference, (family, kv_type))


@pytest.mark.llama_cpp
@pytest.mark.parametrize("kind", ["q8_0", "f32"])
def test_gemma4_is_llama_cpps_graph_up_to_the_final_soft_cap(gguf_files, monkeypatch, kind):
    """Given ggml's GELU (as tests/test_llama_cpp_logits.py gives it) and ggml's soft-cap ops
    on moeswap's uncapped logits, Gemma 4's logits with an f16 cache are llama.cpp's bit for
    bit, f32 file too: every layer is llama.cpp's graph; the final soft-cap's tanh is torch's
    (1.6e-7 from llama.cpp's)."""
    pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    from test_llama_cpp_logits import use_ggml_gelu

    use_ggml_gelu(monkeypatch)
    path = gguf_files("gemma4", kind)
    model = load_model(path, kv_type="f16", repack=True)  # as `moeswap run`: experts in the graph
    cap = model.config.final_logit_softcap
    monkeypatch.setattr(model.config, "final_logit_softcap", 0.0)
    uncapped = logits(model, PROMPT).contiguous()  # [T, V]
    kernels, ggml = model.layers[0].graph.kernels, model.layers[0].graph.ggml
    context = ggml.ggml_init(InitParams(8 * ggml.ggml_tensor_overhead()
                                        + ggml.ggml_graph_overhead_custom(8, False), None, True))
    arena = Arena(kernels, context)
    x = arena.new(0, uncapped.shape[1], uncapped.shape[0])
    y = arena.op(ggml.ggml_scale(context, arena.op(ggml.ggml_tanh(context, arena.op(
        ggml.ggml_scale(context, x, float(np.float32(1.0) / np.float32(cap)))))), cap))
    graph = ggml.ggml_new_graph_custom(context, 8, False)
    ggml.ggml_build_forward_expand(graph, y)
    capped = torch.empty_like(uncapped)
    kernels.run(graph, [(arena.offsets[x], uncapped.data_ptr(), uncapped.nbytes)],
                (capped.data_ptr(), capped.nbytes), arena.offsets[y])
    ggml.ggml_free(context)
    assert np.array_equal(capped.numpy(), tiny_models.llama_cpp_scores(path, PROMPT, 1))


@pytest.mark.parametrize("family", ["deepseek2", "gemma4"])
def test_several_sequences_and_a_truncated_cache(gguf_files, family):
    """Sequences of one forward each attend their own cache (each equals its own run), and a
    truncated cache continues as a fresh one (the server's prefix reuse; Gemma 4's rings)."""
    model = load_model(gguf_files(family), kv_type="f16")
    prompts = [PROMPT[:7], PROMPT[7:18], PROMPT[18:23]]
    together = model.forward(prompts, [model.new_cache() for _ in prompts])
    assert all(torch.equal(out, logits(model, p)) for out, p in zip(together, prompts))
    cache = model.new_cache()
    logits(model, PROMPT[:3], cache)
    logits(model, torch.cat([PROMPT[3:6], PROMPT[30:31]]), cache)
    assert cache.can_truncate(6)
    cache.truncate(6)
    fresh = model.new_cache()
    logits(model, PROMPT[:6], fresh)
    assert torch.equal(logits(model, PROMPT[6:12], cache), logits(model, PROMPT[6:12], fresh))


@pytest.mark.parametrize("family, attention", [("deepseek2", "MLAttention"),
                                               ("gemma4", "Gemma4Attention")])
def test_a_q8_0_cache_is_refused(gguf_files, family, attention):
    """These graphs read f32 and f16 caches (llama.cpp takes a quantized cache with flash
    attention only)."""
    with pytest.raises(MoeswapError, match="runs as a graph that reads f32 and f16 caches only "
                                           rf"\(layer 0: its attention is {attention}\)"):
        load_model(gguf_files(family), kv_type="q8_0")
