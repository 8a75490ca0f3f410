"""--kv-type: an f16 KV cache holds and is charged half of f32's bytes, everywhere.

Tiny Gemma 3 (sliding-window rings, crossed many times), DeepSeek-V2-Lite (MLA latents) and
GPT-OSS (rings and sinks) run 40 tokens token by token and in chunks with an f16 cache sized
to the charge: the buffers are f16, hold exactly what ``kv_cache_bytes(..., "f16")`` charges,
and the logits stay near the f32 cache's (the f16 rounding is the only difference) and agree
between chunkings. The library's default stays f32; `moeswap plan --kv-type f16` halves the
moeswap KV line; the command line defaults to f16. The comparison with llama.cpp run with
f16 KV is in tests/test_llama_cpp_logits.py.
"""

from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from moeswap.cli import main
from moeswap.experts.build import load_options
from moeswap.gguf_tools.convert import convert
from moeswap.memory import HostCharge, kv_cache_bytes, kv_widening_bytes
from moeswap.models import load_model

N_TOKENS = 40
STEP = 12
TOKENS = torch.randint(0, tiny_models.VOCAB, (N_TOKENS,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module", params=("gemma3", "deepseek2_lite", "gpt_oss"))
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    overrides = {} if request.param == "deepseek2_lite" else {"sliding_window": 5}
    tiny_models.save(request.param, path, **overrides)
    return path


def run(model, chunks: list[int]) -> tuple[torch.Tensor, object]:
    """TOKENS fed in chunks of these sizes to a new cache -> logits [N_TOKENS, V], the cache."""
    cache, out, at = model.new_cache(), [], 0
    for n in chunks:
        out.append(model.forward([TOKENS[at:at + n]], [cache])[0])
        at += n
    return torch.cat(out), cache


def test_an_f16_cache_is_half_the_bytes_and_keeps_the_logits(folder):
    f32 = load_model(folder, context_tokens=N_TOKENS, step_tokens=STEP)
    f16 = load_model(folder, context_tokens=N_TOKENS, step_tokens=STEP, kv_type="f16")
    reference, _ = run(f32, [STEP] + [1] * (N_TOKENS - STEP))
    by_token, cache = run(f16, [STEP] + [1] * (N_TOKENS - STEP))
    chunked, _ = run(f16, [STEP, STEP, STEP, N_TOKENS - 3 * STEP])
    c = f16.config
    assert all(s.keys.dtype == torch.float16 for s in cache._layers)
    assert 2 * cache.n_floats() == kv_cache_bytes(c, N_TOKENS, step_tokens=STEP, kv_type="f16")
    assert 2 * kv_cache_bytes(c, N_TOKENS, 1, STEP, "f16") == kv_cache_bytes(c, N_TOKENS, 1, STEP)
    assert tiny_models.relative_error(by_token, reference) < 5e-3  # the f16 rounding of keys, values, q, probs
    assert tiny_models.relative_error(chunked, by_token) < 1e-3
    assert torch.equal(by_token.argmax(-1), reference.argmax(-1))


def test_the_charge_follows_the_type(folder):
    c = load_model(folder).config
    f32, f16 = HostCharge.for_batch(64, 3, 8), HostCharge.for_batch(64, 3, 8, "f16")
    assert 2 * f16.kv_bytes(c) == f32.kv_bytes(c)
    # attend widens one layer of one sequence's f16 cache to f32 for the step
    assert f16.working_bytes(c) == f32.working_bytes(c) + kv_widening_bytes(c, 64, "f16")
    assert kv_widening_bytes(c, 64, "f32") == 0
    assert "--kv-type f16" in f32.shortfall(1, f32.terms(c, 0, 0), 0)
    assert load_options(None, f16) == {"kv_type": "f16"}  # all resident: still an f16 cache


def test_the_library_default_stays_f32(folder):
    assert load_model(folder).new_cache().dtype == torch.float32


def test_plan_kv_type_halves_the_moeswap_kv_line(tmp_path, capsys):
    tiny_models.save("qwen3moe", tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "model.gguf", "f32")

    def plan(*flags: str) -> dict:
        assert main(["plan", str(path), "--host-mem", "1GiB", "--ctx", "256", "--json",
                     *flags]) == 0
        return json.loads(capsys.readouterr().out)

    f16, f32 = plan(), plan("--kv-type", "f32")  # f16: the command line's default
    assert f16["budget"]["kv_type"] == "f16"
    assert 2 * f16["kv_cache"]["moeswap_charge_bytes"] == f32["kv_cache"]["moeswap_charge_bytes"]
    assert f16["kv_cache"]["moeswap_charge_bytes"] == f16["kv_cache"]["context_bytes_f16"]
    assert f32["moeswap"]["command"][-2:] == ["--kv-type", "f32"]
    assert "--kv-type" not in f16["moeswap"]["command"]
