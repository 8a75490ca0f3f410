"""One shared runner over a tiny random model of every family: moeswap against transformers.

For each family, moeswap loaded from (a) the saved HF folder and (b) the f32 GGUF written by
``moeswap convert`` must give transformers' logits (max|diff| / max|ref| <= 1e-4) over a
16-token prompt; decoding token by token, alone or in a batch of three sequences at
different positions, must give the full forward's logits.
"""

from __future__ import annotations

import pytest
import torch

import tiny_models
from moeswap.formats.gguf_weights import GGUFWeights
from moeswap.gguf_tools.convert import convert
from moeswap.models import load_model
from moeswap.models.experts import ResidentExperts
from moeswap.models.quant_experts import QuantResidentExperts

PROMPT = torch.randint(0, tiny_models.VOCAB, (16,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=tiny_models.FAMILIES)
def family_files(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = tiny_models.save(request.param, folder / "hf")
    gguf_path = convert(folder / "hf", folder / "model.f32.gguf", "f32")
    return request.param, reference, folder / "hf", gguf_path


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.forward([ids], [model.new_cache()])[0]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_match_transformers(family_files, source):
    family, reference, hf_dir, gguf_path = family_files
    model = load_model(hf_dir if source == "hf" else gguf_path)
    expected = tiny_models.reference_logits(reference, PROMPT.tolist())
    out = full_logits(model, PROMPT)
    assert out.dtype == torch.float32 and out.shape == (16, tiny_models.VOCAB)
    assert tiny_models.relative_error(out, expected) <= 1e-4, family


def test_kv_cache_holds_what_the_config_says(family_files):
    """MLA's latent cache and Gemma 4's per-type heads included: the planner's number is real."""
    _, _, _, gguf_path = family_files
    model = load_model(gguf_path)
    cache = model.new_cache()
    model.forward([PROMPT], [cache])
    assert cache.n_floats() == len(PROMPT) * model.config.kv_floats_per_token


def test_incremental_decode_equals_full_forward(family_files):
    _, _, _, gguf_path = family_files
    model = load_model(gguf_path)
    full = full_logits(model, PROMPT)
    cache = model.new_cache()
    steps = [model.forward([PROMPT[:7]], [cache])[0]]
    steps += [model.forward([PROMPT[i:i + 1]], [cache])[0] for i in range(7, 16)]
    assert cache.length == 16
    assert tiny_models.relative_error(torch.cat(steps), full) <= 1e-5


def test_batch_of_three_at_different_positions(family_files):
    _, _, _, gguf_path = family_files
    model = load_model(gguf_path)
    g = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, tiny_models.VOCAB, (n,), generator=g) for n in (16, 9, 12)]
    expected = [full_logits(model, s) for s in sequences]
    caches = [model.new_cache() for _ in sequences]
    prefill = (3, 6, 1)  # each sequence starts decoding from a different position
    got = [[out] for out in model.forward([s[:p] for s, p in zip(sequences, prefill)], caches)]
    for step in range(max(len(s) - p for s, p in zip(sequences, prefill))):
        live = [i for i, (s, p) in enumerate(zip(sequences, prefill)) if p + step < len(s)]
        outs = model.forward([sequences[i][prefill[i] + step:prefill[i] + step + 1] for i in live],
                             [caches[i] for i in live])
        for i, out in zip(live, outs):
            got[i].append(out)
    for i, seq in enumerate(sequences):
        assert caches[i].length == len(seq)
        assert tiny_models.relative_error(torch.cat(got[i]), expected[i]) <= 1e-5


def float_runner(gguf, kernels, layers: list[int], activation: str) -> ResidentExperts:
    """The torch runner HF folders get, forced onto a GGUF file."""
    return ResidentExperts.from_weights(GGUFWeights(gguf), layers, activation)


def test_ggml_expert_runner_equals_float_runner(family_files):
    """The runner every GGUF gets (ggml on the mapped stacks, F32 ones too) against the torch
    float runner on the same f32 file: biases, per-expert scales and fused layouts are
    computed alike."""
    family, _, _, gguf_path = family_files
    if family == "gemma3":
        pytest.skip("Gemma 3 is dense: no routed experts")
    ggml_model = load_model(gguf_path)
    assert all(isinstance(layer.ffn.experts, QuantResidentExperts) for layer in ggml_model.layers
               if hasattr(getattr(layer, "ffn", None), "experts"))
    expected = full_logits(load_model(gguf_path, expert_runner=float_runner), PROMPT)
    assert tiny_models.relative_error(full_logits(ggml_model, PROMPT), expected) <= 1e-5


def test_one_expert_is_read_alone_and_equals_its_slice(family_files):
    family, _, hf_dir, gguf_path = family_files
    if family == "gemma3":
        pytest.skip("Gemma 3 is dense: no routed experts")
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.formats.gguf_weights import GGUFWeights
    from moeswap.formats.safetensors_weights import SafetensorsWeights

    sources = [GGUFWeights(GGUFFile.open(gguf_path)), SafetensorsWeights(hf_dir)]
    layer = sources[1].config.moe_layers[-1]
    for kind in ("gate", "up", "down"):
        stacked = [s.experts(layer, kind) for s in sources]
        assert torch.equal(stacked[0], stacked[1])
        for source in sources:
            assert torch.equal(source.expert(layer, 3, kind), stacked[0][3])


def test_gemma4_vision_bidirectional_attention_leaves_text_causal(tmp_path):
    """The published Gemma 4 config says use_bidirectional_attention "vision": image tokens
    only, so a text prompt runs exactly as the causal model does."""
    reference = tiny_models.save("gemma4", tmp_path, use_bidirectional_attention="vision")
    expected = tiny_models.reference_logits(reference, PROMPT.tolist())
    assert tiny_models.relative_error(full_logits(load_model(tmp_path), PROMPT), expected) <= 1e-4
