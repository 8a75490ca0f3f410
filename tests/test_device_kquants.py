"""The device tier's K-quant and MXFP4 experts (moeswap/experts/device.py, device_dequant.py),
run on CPU tensors: dequantization bit for bit gguf-py's, activations rounded as ggml's CPU
rounds them, products as close to ggml's kernels as summation order allows, and a K-quant model
whose device-tier logits agree with the resident CPU model's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

import tiny_models
from gguf_builders import rewrite_experts
from moeswap.experts.device import (
    ACTIVATION_ROUNDING, DEVICE_TYPES, _DeviceMatrix, round_to_q8_0, round_to_q8_k)
from moeswap.experts.device_dequant import DEQUANTIZERS, dequantize
from moeswap.gguf_tools.convert import convert

# Byte offsets of each block's fp16 scales (random bytes there could be NaN or huge); every
# other byte of a block may be anything.
HALF_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.MXFP4: (), Q.Q2_K: (80, 82),
                Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
GGUF_QUANTIZABLE = {Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.MXFP4}


def random_blocks(rng: np.random.Generator, ggml_type: Q, rows: int, width: int) -> np.ndarray:
    """[rows, row bytes] of random blocks with sane fp16 scales (MXFP4: exponents that keep
    12 * 2^(e-128) finite, the subnormal e < 2 included)."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (rows * width // block_size, type_size), dtype=np.uint8)
    for offset in HALF_OFFSETS[ggml_type]:
        scales = rng.uniform(-2e-2, 2e-2, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if ggml_type == Q.MXFP4:
        blocks[:, 0] = rng.integers(0, 253, blocks.shape[0])
    return blocks.reshape(rows, -1)


def as_bits(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(torch.int32)


def test_every_device_type_has_a_dequantizer_and_a_rounding():
    assert set(DEQUANTIZERS) | {int(Q.F32), int(Q.F16)} == DEVICE_TYPES == set(ACTIVATION_ROUNDING)


@pytest.mark.parametrize("ggml_type", sorted(HALF_OFFSETS), ids=lambda t: t.name)
def test_dequantize_is_gguf_py_bit_for_bit(ggml_type):
    """Every bit of every float32, -0.0 and subnormals included (torch.equal on the bits)."""
    rng = np.random.default_rng(int(ggml_type))
    rows, width = 9, 3 * 256
    stored = [random_blocks(rng, ggml_type, rows, width)]
    if ggml_type in GGUF_QUANTIZABLE:  # blocks as a quantizer writes them, too
        values = rng.standard_normal((rows, width)).astype(np.float32)
        stored.append(gguf_quantize(values, ggml_type))
    for raw in stored:
        expected = torch.from_numpy(gguf_dequantize(raw, ggml_type).astype(np.float32))
        got = dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(ggml_type), rows, width)
        assert got.dtype == torch.float32
        assert torch.equal(as_bits(got), as_bits(expected)), ggml_type.name


def nearest_int(fval: np.float32) -> int:
    """ggml-quants.c's nearest_int: the float trick that rounds half to even."""
    val = np.float32(np.float32(fval) + np.float32(12582912.0))
    return int((val.view(np.int32) & 0x007FFFFF) - 0x00400000)


def quantize_row_q8_k_ref(x: np.ndarray) -> np.ndarray:
    """A transcription of ggml's quantize_row_q8_K_ref, then each value's q * d in float32."""
    out = np.zeros_like(x, dtype=np.float32)
    for start in range(0, x.size, 256):
        block = x[start:start + 256].astype(np.float32)
        amax, signed_max = np.float32(0), np.float32(0)
        for value in block:
            if abs(value) > amax:
                amax, signed_max = abs(value), value
        if not amax:
            continue
        iscale = np.float32(-127.0) / signed_max
        q = np.array([min(127, nearest_int(iscale * value)) for value in block], np.float32)
        d = np.float32(1.0) / iscale
        out[start:start + 256] = q * d
    return out


def test_q8_k_rounding_is_ggml_quantize_row_q8_k_ref():
    rng = np.random.default_rng(11)
    rows = rng.standard_normal((3, 1024)).astype(np.float32) * np.float32(0.3)
    rows[0, 256:512] = 0  # an all-zero block stays zero
    rows[1, :256] = rng.integers(-126, 126, 256) + np.float32(0.5)  # halves: ties to even
    rows[1, 7] = -127  # max -127: iscale = d = 1, so q * d = nearest_int(x)
    rows[2, 300] = 9.0  # a positive max: iscale < 0
    expected = np.stack([quantize_row_q8_k_ref(row) for row in rows])
    got = round_to_q8_k(torch.from_numpy(rows))
    assert torch.equal(got, torch.from_numpy(expected))  # -0.0 = +0.0: ggml's q is an int
    assert np.array_equal(expected[1, :256], np.round(rows[1, :256]))  # numpy: half to even
    assert not np.array_equal(expected[1, :256], np.floor(rows[1, :256] + np.float32(0.5)))


def test_q8_0_rounding_is_ggml_x86_quantize_row_q8_0():
    """ggml's AVX2 quantize_row_q8_0: d = amax / 127 stored as fp16, q = rint(x * (127 / amax))
    with both divisions correctly rounded (torch's x / float may multiply by 1 / float)."""
    rng = np.random.default_rng(12)
    rows = (rng.standard_normal((4, 512)) * rng.uniform(1e-3, 10, (4, 1))).astype(np.float32)
    rows[0, :32] = 0
    blocks = rows.reshape(4, -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0))
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
    q = np.rint(blocks * inverse).astype(np.int32)  # ggml stores q as int8
    expected = (q.astype(np.float32) * d).reshape(rows.shape)
    got = round_to_q8_0(torch.from_numpy(rows))
    assert torch.equal(got, torch.from_numpy(expected))  # -0.0 = +0.0: ggml's q is an int


# Device product versus ggml's, largest difference over the largest ggml output: only the
# summation order (and Q8_K's q * d in float32) differs. Without the activation rounding the
# products differ by far more (checked below), so the bound tells the rounding apart.
PRODUCT_BOUND = 2e-6
PRODUCT_TYPES = [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def device_and_ggml_products(raw: np.ndarray, ggml_type: Q, x: torch.Tensor):
    """The quantized rows ``raw`` [O, row bytes] times the tokens ``x`` [M, I] on the device tier
    and by ggml's CPU kernels -> (device product [M, 1, O], ggml's, the weights' bytes)."""
    from moeswap.quant import CpuKernels

    height, width = raw.shape[0], x.shape[1]
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int32)
    expected = CpuKernels(1).experts(raw, ggml_type, (width, height, 1)).matmul(x, ids)
    weights = torch.from_numpy(raw.reshape(-1).copy())
    got = _DeviceMatrix(weights, int(ggml_type), (width, height)).matmul(x, ids)
    return got, expected, weights


def products_compared_with_ggml(monkeypatch) -> list[float]:
    """From now on every product the device tier computes is also computed by ggml's CPU
    kernels -> the list that each one's largest difference, relative, is appended to."""
    from moeswap.experts import device
    from moeswap.quant import CpuKernels

    kernels, product_errors = CpuKernels(1), []
    on_device = device._DeviceMatrix.matmul

    def compared_with_ggml(matrix, x, ids):
        got = on_device(matrix, x, ids)
        raw = matrix.raw.numpy().reshape(matrix.out_features, -1)
        ne = (matrix.in_features, matrix.out_features, 1)
        expected = kernels.experts(raw, matrix.ggml_type, ne).matmul(x, ids)
        product_errors.append(float((got - expected).abs().max() / expected.abs().max()))
        return got

    monkeypatch.setattr(device._DeviceMatrix, "matmul", compared_with_ggml)
    return product_errors


@pytest.mark.llama_cpp
@pytest.mark.parametrize("ggml_type", PRODUCT_TYPES, ids=lambda t: t.name)
def test_device_products_match_ggml_up_to_summation_order(ggml_type):
    pytest.importorskip("llama_cpp", reason="ggml's CPU kernels come from llama-cpp-python")
    from moeswap.quant import quantize_rows

    width, height, n_tokens = 1024, 48, 5
    rng = np.random.default_rng(200 + int(ggml_type))
    raw = quantize_rows(rng.standard_normal((height, width)).astype(np.float32), ggml_type)
    x = torch.from_numpy(rng.standard_normal((n_tokens, width)).astype(np.float32))
    got, expected, weights = device_and_ggml_products(raw, ggml_type, x)
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) / scale <= PRODUCT_BOUND, ggml_type.name
    unrounded = x @ dequantize(weights, int(ggml_type), height, width).T  # [M, O]
    assert float((unrounded[:, None] - expected).abs().max()) / scale > 10 * PRODUCT_BOUND


# -- a tiny Mixtral whose experts are K-quants or MXFP4, on the device tier ---------------------

EXPERT_TYPES = {  # (gate, up, down): the mixes real files use
    "q4_k_m": (Q.Q4_K, Q.Q4_K, Q.Q6_K), "q2_k": (Q.Q2_K, Q.Q2_K, Q.Q3_K),
    "q5_k": (Q.Q5_K, Q.Q5_K, Q.Q5_K), "mxfp4": (Q.MXFP4, Q.MXFP4, Q.MXFP4)}


def with_expert_types(source, path, types: tuple[Q, Q, Q]):
    """Copy the GGUF ``source`` with its gate, up and down expert stacks quantized (by ggml's
    quantizer: gguf-py has none for the K-quants) to ``types``."""
    from moeswap.quant import quantize_rows

    def stored(kind, data):
        packed = quantize_rows(data.reshape(-1, data.shape[-1]), types[kind])
        return packed.reshape(*data.shape[:-1], -1), types[kind]

    return rewrite_experts(source, path, stored)


@pytest.fixture(scope="module")
def calm_f32_mixtral(tmp_path_factory):
    """Weights of std 0.02 (a model where one rounding difference does not grow), 256 wide
    so that every expert row is whole blocks of 256; seed 3: see the test below."""
    folder = tmp_path_factory.mktemp("calm_k")
    tiny_models.save("mixtral", folder / "hf", seed=3, initializer_range=0.02, hidden_size=256,
                     intermediate_size=256)
    return convert(folder / "hf", folder / "model.f32.gguf", "f32")


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mix", sorted(EXPERT_TYPES))
def test_device_tier_agrees_with_the_cpu_kernels_on_k_quants(calm_f32_mixtral, mix, tmp_path,
                                                             monkeypatch):
    """As test_expert_store's test_torch_device_tier_agrees_with_the_cpu_kernels, for experts
    stored as the K-quants and MXFP4: the same bound, every argmax equal; and every product the
    device computes in the run is ggml's product of the same input within PRODUCT_BOUND.

    The logit bound needs a model and prompt where no activation's rounding flips: a summation
    order difference of 1e-7 upstream can move one value across a Q8_K rounding boundary, one
    step of that block's d. Measured on seeds 0-4 (15 K-quant runs): 4 had such a flip, 2.5e-4
    to 1.7e-3 relative, argmax still equal; the other 11 and all 5 MXFP4 runs 2e-7 to 4.2e-7.
    Seed 3 has none."""
    pytest.importorskip("llama_cpp", reason="the resident reference runs ggml's CPU kernels")
    from test_expert_store import assert_device_tier_agrees

    from moeswap.formats.gguf_file import GGUFFile

    path = with_expert_types(calm_f32_mixtral, tmp_path / f"{mix}.gguf", EXPERT_TYPES[mix])
    stored = {t.ggml_type for t in GGUFFile.open(path).tensors if t.name.endswith("_exps.weight")}
    assert stored == set(EXPERT_TYPES[mix])
    product_errors = products_compared_with_ggml(monkeypatch)
    assert_device_tier_agrees(path)
    assert product_errors and max(product_errors) <= PRODUCT_BOUND


@pytest.mark.llama_cpp
def test_other_expert_types_are_refused_a_device_budget_by_name(calm_f32_mixtral, tmp_path):
    pytest.importorskip("llama_cpp", reason="ggml quantizes the experts to Q4_1")
    from test_expert_store import store_model

    from moeswap.errors import MoeswapError

    path = with_expert_types(calm_f32_mixtral, tmp_path / "q4_1.gguf", (Q.Q4_1, Q.Q4_1, Q.Q4_1))
    with pytest.raises(MoeswapError, match=r"'blk\.0\.ffn_down_exps\.weight' has a type the cpu "
                       r"device tier cannot compute yet \(it computes F32, F16, .*Q6_K, .*MXFP4\)"):
        store_model(path, 1, 2, miss="transfer", device_backend="cpu")
    store_model(path, 1, 0)  # without a device budget it runs
