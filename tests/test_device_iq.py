"""The device tier's IQ1-IQ3 experts (moeswap/experts/device_iq.py), run on CPU tensors as
tests/test_device_kquants.py runs the K-quants: dequantization bit for bit gguf-py's, products
ggml's up to summation order, and a model with IQ experts on the device tier agreeing with the
resident CPU kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from moeswap.experts.device import DEVICE_TYPES
from moeswap.experts.device_dequant import dequantize
from test_device_kquants import (PRODUCT_BOUND, as_bits, calm_f32_mixtral,  # noqa: F401
                                 device_and_ggml_products, products_compared_with_ggml)

IQ_TYPES = [Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S]


def random_iq_blocks(rng: np.random.Generator, ggml_type: Q, rows: int, width: int):
    """[rows, row bytes] of random blocks with a sane fp16 scale: at byte 0, or for IQ1_M in
    the top nibbles of its four uint16 scale words (bytes 48-55). Every index of these formats
    addresses a grid point, so every other byte may be anything."""
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (rows * width // 256, type_size), dtype=np.uint8)
    half = rng.uniform(-2e-2, 2e-2, blocks.shape[0]).astype(np.float16).view(np.uint16)
    if ggml_type != Q.IQ1_M:
        blocks[:, :2] = half.view(np.uint8).reshape(-1, 2)
    else:
        words = blocks[:, 48:56].copy().view(np.uint16)  # [N, 4]
        for i in range(4):  # nibble i of d in the top nibble of word i
            words[:, i] = (words[:, i] & 0x0FFF) | (((half >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    return blocks.reshape(rows, -1)


def quantized(values: np.ndarray, ggml_type: Q) -> np.ndarray:
    from moeswap.quant.kernels import needs_importance, quantize_rows

    uniform = np.ones(values.shape[1], np.float32) if needs_importance(ggml_type) else None
    return quantize_rows(values, ggml_type, uniform)


def test_the_device_computes_every_iq_grid():
    assert {int(t) for t in IQ_TYPES} <= DEVICE_TYPES


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_dequantize_is_gguf_py_bit_for_bit(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    rows, width = 9, 3 * 256
    for raw in (random_iq_blocks(rng, ggml_type, rows, width),):
        expected = torch.from_numpy(gguf_dequantize(raw, ggml_type).astype(np.float32))
        got = dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(ggml_type), rows, width)
        assert torch.equal(as_bits(got), as_bits(expected)), ggml_type.name


@pytest.mark.llama_cpp
@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_device_products_match_ggml_up_to_summation_order(ggml_type):
    pytest.importorskip("llama_cpp", reason="ggml's CPU kernels come from llama-cpp-python")
    width, height, n_tokens = 1024, 48, 5
    rng = np.random.default_rng(300 + int(ggml_type))
    raw = quantized(rng.standard_normal((height, width)).astype(np.float32), ggml_type)
    x = torch.from_numpy(rng.standard_normal((n_tokens, width)).astype(np.float32))
    got, expected, weights = device_and_ggml_products(raw, ggml_type, x)
    assert torch.equal(dequantize(weights, int(ggml_type), height, width),
                       torch.from_numpy(gguf_dequantize(raw, ggml_type)))
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) / scale <= PRODUCT_BOUND, ggml_type.name


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mix", [(Q.IQ2_XXS, Q.IQ2_XXS, Q.IQ3_S), (Q.IQ1_M, Q.IQ1_M, Q.IQ2_S)],
                         ids=lambda m: "-".join(t.name for t in m))
def test_device_tier_agrees_with_the_cpu_kernels_on_iq_experts(
        calm_f32_mixtral, mix, tmp_path, monkeypatch):  # noqa: F811 (the imported fixture)
    """Every product the device computes in a decode is ggml's within PRODUCT_BOUND; the logits
    agree with the resident CPU model's, every argmax equal. The logit bound is 2e-3, not
    test_expert_store's 1e-4: a summation-order difference upstream can move one activation
    across a Q8_K rounding step (test_device_kquants.py measured 2.5e-4 to 1.7e-3 for the
    K-quants); the IQ2_XXS mix here shows 1.8e-4."""
    pytest.importorskip("llama_cpp", reason="the resident reference runs ggml's CPU kernels")
    from gguf_builders import rewrite_experts
    from test_expert_store import decode_logits, plan, store_model

    from moeswap.models import load_model
    from moeswap.models.quant_experts import QuantResidentExperts

    def stored(kind, data):
        packed = quantized(data.reshape(-1, data.shape[-1]), mix[kind])
        return packed.reshape(*data.shape[:-1], -1), mix[kind]

    path = rewrite_experts(calm_f32_mixtral, tmp_path / "iq.gguf", stored)
    expected = decode_logits(load_model(path, threads=1, expert_runner=QuantResidentExperts))
    product_errors = products_compared_with_ggml(monkeypatch)
    _, _, layers, n_experts = plan(path)
    for device_slots in (len(layers), len(layers) * n_experts):
        model, factory = store_model(path, 1, device_slots, miss="transfer",
                                     device_backend="cpu")
        got = decode_logits(model)
        assert float((got - expected).abs().max() / expected.abs().max()) <= 2e-3
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        assert factory.stats()["total"]["transfers"] > 0
    assert product_errors and max(product_errors) <= PRODUCT_BOUND


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda)")
@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_cuda_dequantizes_iq_grids_bit_for_bit(ggml_type):
    """On CUDA the same ops give gguf-py's bits: the grids are copied to the device once."""
    rng = np.random.default_rng(400 + int(ggml_type))
    raw = random_iq_blocks(rng, ggml_type, 16, 4 * 256)
    expected = torch.from_numpy(gguf_dequantize(raw, ggml_type).astype(np.float32))
    got = dequantize(torch.from_numpy(raw.reshape(-1).copy()).cuda(), int(ggml_type), 16, 1024)
    assert torch.equal(as_bits(got.cpu()), as_bits(expected)), ggml_type.name
