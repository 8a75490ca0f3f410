"""DeepSeek-V3 / R1 / Kimi-K2 (GGUF arch deepseek2): sigmoid routing, the selection bias
``exp_probs_b`` and group-limited expert choice, on files written by llama.cpp's own
convert_hf_to_gguf.py (MOESWAP_LLAMA_CPP_CONVERT, as in tests/test_convert_reference.py).

The tiny DeepseekV3ForCausalLM (tests/tiny_models.py, "deepseek3") has 8 experts in 4 groups
of which 2 are kept, top-3, and a selection bias drawn wide enough that dropping it, or the
group limit, changes the experts chosen for many tokens (asserted below). Its HF folder and its
f32 GGUF give transformers' logits and greedy continuation; its f32 and q8_0 GGUFs give
llama.cpp's logits. A Kimi-K2-shaped twin (no groups, YaRN beta_fast = beta_slow = 1) shows
where the two references part: llama.cpp's deepseek2 loader ignores the beta keys (32 / 1), so
its GGUF is held to llama.cpp and its folder to transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny_models
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models import load_model
from test_convert_reference import SENTENCEPIECE_VOCAB

SCRIPT = os.environ.get("MOESWAP_LLAMA_CPP_CONVERT", "")
PROMPT = torch.randint(0, tiny_models.VOCAB, (16,), generator=torch.Generator().manual_seed(1))
GGML_TYPE_F32 = 0
# Kimi-K2's published routing and YaRN shape: no expert groups, beta_fast = beta_slow = 1.
KIMI_K2 = dict(n_group=1, topk_group=1, rope_parameters={
    "rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
    "original_max_position_embeddings": 16, "beta_fast": 1.0, "beta_slow": 1.0,
    "mscale": 1.0, "mscale_all_dim": 1.0})

pytestmark = pytest.mark.skipif(not Path(SCRIPT).is_file(), reason=(
    "set MOESWAP_LLAMA_CPP_CONVERT to llama.cpp's convert_hf_to_gguf.py (from the "
    "llama-cpp-python 0.3.36 sdist): these files come from the reference converter"))


def reference_convert(folder: Path, out_type: str) -> Path:
    """llama.cpp's converter on the folder (its SentencePiece reader for the tiny vocabulary)."""
    wrapper = folder.parent / "reference_with_sentencepiece.py"
    wrapper.write_text(SENTENCEPIECE_VOCAB)
    out = folder.parent / f"model.{out_type}.gguf"
    subprocess.run([sys.executable, str(wrapper), SCRIPT, str(folder), "--outtype", out_type,
                    "--outfile", str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module", params=["deepseek3", "kimi_k2"])
def files(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    overrides = KIMI_K2 if request.param == "kimi_k2" else {}
    reference = tiny_models.save("deepseek3", root / "hf", **overrides)
    return (request.param, reference, root / "hf",
            {t: reference_convert(root / "hf", t) for t in ("f32", "q8_0")})


def moeswap_logits(path) -> torch.Tensor:
    model = load_model(path)
    return model.forward([PROMPT], [model.new_cache()])[0]


def llama_cpp_logits(path, kv_type: int = GGML_TYPE_F32) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, type_k=kv_type,
                          type_v=kv_type, flash_attn=False, n_threads=2, verbose=False)
    llm.eval(PROMPT.tolist())
    return np.array(llm.scores[: len(PROMPT)], dtype=np.float64)


def assert_matches_transformers(model, reference) -> None:
    """PROMPT's logits within 1e-4 of transformers', and the same 8-token greedy continuation."""
    expected = tiny_models.reference_logits(reference, PROMPT.tolist())
    assert tiny_models.relative_error(model.forward([PROMPT], [model.new_cache()])[0],
                                      expected) <= 1e-4

    def ours(ids):
        return model.forward([torch.tensor(ids)], [model.new_cache()])[0][-1]

    def theirs(ids):
        return tiny_models.reference_logits(reference, ids)[-1]

    assert greedy(ours, PROMPT.tolist(), 8) == greedy(theirs, PROMPT.tolist(), 8)


def greedy(next_logits, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(next_logits(ids).argmax()))
    return ids[-steps:]


def test_the_files_carry_v3_routing(files):
    family, _, _, paths = files
    for path in paths.values():
        config = config_from_gguf(GGUFFile.open(path))
        assert config.gating == "sigmoid" and config.expert_weights_norm
        groups = (0, 0) if family == "kimi_k2" else (4, 2)
        assert (config.n_expert_groups > 1) == (groups[0] > 1)
        if groups[0] > 1:
            assert (config.n_expert_groups, config.n_expert_groups_used) == groups
        assert GGUFFile.open(path).tensor("blk.1.exp_probs_b.bias") is not None


@pytest.mark.parametrize("source", ["hf", "f32"])
def test_logits_and_greedy_continuation_match_transformers(files, source):
    family, reference, hf_dir, paths = files
    if family == "kimi_k2" and source == "f32":
        pytest.skip("Kimi-K2's GGUF runs llama.cpp's YaRN (beta 32 / 1), not transformers' (1 / 1)")
    assert_matches_transformers(load_model(hf_dir if source == "hf" else paths["f32"]), reference)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_gguf_matches_llama_cpp(files, out_type):
    """Within 1e-4, except the Kimi-K2 twin's q8_0 file: 15 of its 16 rows are llama.cpp's bit
    for bit, one (row 7) is off by 1.7e-3 — a last-layer one-ulp difference crossing a Q8_0
    rounding step (no routing near-tie there; recomputing RMSNorm, SiLU, the sigmoid or the
    attention in float64 does not move it), not yet pinned to its op (docs/ARCHITECTURES.md)."""
    family, _, _, paths = files
    path = paths[out_type]
    error = tiny_models.relative_error(moeswap_logits(path), llama_cpp_logits(path))
    assert error <= (2e-3 if (family, out_type) == ("kimi_k2", "q8_0") else 1e-4)


def test_kimi_k2_yarn_betas_follow_llama_cpp(files):
    """The folder reads beta 1 / 1 as transformers does; the GGUF (which carries them) 32 / 1."""
    family, _, hf_dir, paths = files
    if family != "kimi_k2":
        pytest.skip("the V3 twin uses the default betas")
    assert GGUFFile.open(paths["f32"]).get("deepseek2.rope.scaling.yarn_beta_fast") == 1.0
    gguf_yarn = config_from_gguf(GGUFFile.open(paths["f32"])).yarn
    hf_yarn = load_model(hf_dir).config.yarn
    assert (gguf_yarn.beta_fast, gguf_yarn.beta_slow) == (32.0, 1.0)
    assert (hf_yarn.beta_fast, hf_yarn.beta_slow) == (1.0, 1.0)


def router_inputs(model) -> dict[int, torch.Tensor]:
    """{MoE layer: the hidden states [N, D] its transformers router saw on PROMPT}."""
    inputs = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda gate, args, out, i=i: inputs.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    tiny_models.reference_logits(model, PROMPT.tolist())
    for hook in hooks:
        hook.remove()
    return inputs


def test_selection_bias_and_group_limit_change_the_routing(tmp_path):
    """In transformers' own router, on the tiny model's real hidden states: dropping the bias,
    or the group limit, changes the chosen experts of many tokens in every MoE layer."""
    model = tiny_models.build("deepseek3")
    inputs = router_inputs(model)
    assert sorted(inputs) == [1, 2]
    for i, h in inputs.items():
        gate = model.model.layers[i].mlp.gate

        def chosen() -> torch.Tensor:
            with torch.no_grad():
                return gate(h)[2].sort(dim=-1).values  # [N, K] expert ids

        full = chosen()
        bias = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        unbiased = chosen()
        gate.e_score_correction_bias.copy_(bias)
        gate.num_group, gate.topk_group = 1, 1
        ungrouped = chosen()
        gate.num_group, gate.topk_group = 4, 2
        for variant in (unbiased, ungrouped):
            changed = (variant != full).any(dim=-1).float().mean()
            assert changed >= 0.25, (i, float(changed))


def test_tools_and_store_hold_the_selection_bias_as_a_shared_weight(files):
    """doctor finds nothing in the converter's file; inspect and the store count exp_probs_b
    with the router (shared, always resident); offload at one expert slot per layer gives the
    resident model's logits bit for bit."""
    from moeswap.experts.store import shared_bytes
    from moeswap.formats.gguf_moe import ROUTER, MoEView
    from moeswap.gguf_tools.doctor import diagnose
    from moeswap.gguf_tools.inspect import inspect_file
    from test_expert_store import assert_offload_equals_resident

    _, _, _, paths = files
    path = paths["q8_0"]
    assert diagnose(path).findings == []
    assert [row.kind for row in inspect_file(path).layers] == ["dense", "moe", "moe"]
    gguf = GGUFFile.open(path)
    for layer in (1, 2):
        bias = gguf.tensor(f"blk.{layer}.exp_probs_b.bias")
        assert bias in MoEView(gguf).layer(layer).of(ROUTER)
    routed = sum(t.n_bytes for t in gguf.tensors if "_exps." in t.name)
    assert shared_bytes(gguf, [1, 2]) == sum(t.n_bytes for t in gguf.tensors) - routed
    assert_offload_equals_resident(path)


def test_multi_token_prediction_layer_is_skipped(tmp_path):
    """DeepSeek-V3 publishes layer 61 (of 61) as its MTP module: llama.cpp's converter skips
    layers from num_hidden_layers on, and so does the folder loader."""
    from safetensors.torch import load_file, save_file

    reference = tiny_models.save("deepseek3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    d = tiny_models.COMMON["hidden_size"]
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        tensors[f"model.layers.3.{name}"] = torch.ones(d)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(d, 2 * d)
    tensors["model.layers.3.self_attn.q_a_proj.weight"] = torch.zeros(48, d)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    expected = tiny_models.reference_logits(reference, PROMPT.tolist())
    assert tiny_models.relative_error(moeswap_logits(tmp_path), expected) <= 1e-4
