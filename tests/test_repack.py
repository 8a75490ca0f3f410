"""ggml's repacked CPU layouts for dense matrices (moeswap/quant/repack.py): products within
test-backend-ops' MUL_MAT bound (NMSE 5e-4) of the dequantize-then-multiply reference, as the
plain layout's; what ggml does not repack stays plain, bit for bit."""

from __future__ import annotations

import platform

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moeswap.quant import CpuKernels, quantize_rows
from moeswap.quant.ggml_lib import load_ggml
from moeswap.quant.reference import reference_matmul

# Types ggml 0.25 repacks on x86 with AVX2 (ggml-cpu/repack.cpp, ggml_repack_get_optimal_repack_type)
X86_REPACKED = (Q.Q4_0, Q.Q4_K, Q.IQ4_NL, Q.MXFP4)


@pytest.fixture(scope="module")
def kernels():
    return CpuKernels(2, repack=True)


def nmse(y: torch.Tensor, reference: torch.Tensor) -> float:
    return (((y.double() - reference) ** 2).sum() / (reference ** 2).sum()).item()


@pytest.mark.parametrize("ggml_type", [*X86_REPACKED, Q.Q8_0, Q.Q6_K])
def test_repacked_products_stay_within_the_mul_mat_bound(kernels, ggml_type):
    generator = torch.Generator().manual_seed(int(ggml_type))
    raw = quantize_rows(torch.randn(256, 1024, generator=generator).numpy(), ggml_type)
    plain = kernels.matrix(raw, ggml_type, (1024, 256), repack=False)
    packed = kernels.matrix(raw, ggml_type, (1024, 256))  # the object's default: repack
    x86_avx2 = platform.machine().lower() in ("x86_64", "amd64") and \
        load_ggml().ggml_cpu_has_avx2()
    if x86_avx2 and ggml_type in X86_REPACKED:
        assert packed.repacked
    assert not plain.repacked
    for n_tokens in (1, 7, 32):
        x = torch.randn(n_tokens, 1024, generator=generator)
        reference = reference_matmul(raw.tobytes(), ggml_type, (1024, 256), x)
        got = packed.matmul(x)
        assert nmse(got, reference) <= 5e-4
        if not packed.repacked:
            assert torch.equal(got, plain.matmul(x))


def test_a_shape_ggml_cannot_repack_stays_plain(kernels):
    raw = quantize_rows(torch.randn(12, 256).numpy(), Q.Q4_0)  # 12 rows: not 4 or 8 at a time
    matrix = kernels.matrix(raw, Q.Q4_0, (256, 12))
    assert not matrix.repacked
    x = torch.randn(3, 256)
    assert torch.equal(matrix.matmul(x), kernels.matrix(raw, Q.Q4_0, (256, 12),
                                                        repack=False).matmul(x))


@pytest.fixture(scope="module")
def mixtral_q4_0(tmp_path_factory):
    import tiny_models

    from moeswap.gguf_tools.convert import convert

    folder = tmp_path_factory.mktemp("mixtral-q4_0-")
    tiny_models.save("mixtral", folder / "hf")
    return convert(folder / "hf", folder / "model.q4_0.gguf", "q4_0")


def test_a_model_with_repacked_shared_weights_keeps_its_logits_and_its_store_exact(
        mixtral_q4_0, monkeypatch):
    """load_model(repack=True), as `moeswap run` loads without --exact-tiers: the shared Q4_0
    matrices and the resident model's expert stacks repack, logits stay near the plain
    layout's, and the expert store (its slots plain) gives the resident model's logits within
    a rounding (bit for bit under exact tiers: tests/test_expert_store.py)."""
    import tiny_models

    from moeswap.experts.build import build_store
    from moeswap.experts.settings import OffloadSettings
    from moeswap.models import load_model

    bound = []
    matrix = CpuKernels.matrix
    monkeypatch.setattr(CpuKernels, "matrix",
                        lambda self, *a, **k: bound.append(matrix(self, *a, **k)) or bound[-1])
    prompt = torch.randint(0, tiny_models.VOCAB, (10,), generator=torch.Generator().manual_seed(3))

    def logits(model):
        cache = model.new_cache()
        return torch.cat([model.forward([prompt[:6]], [cache])[0]] +
                         [model.forward([prompt[i:i + 1]], [cache])[0] for i in range(6, 10)])

    plain = logits(load_model(mixtral_q4_0, threads=1))
    assert bound and not any(m.repacked for m in bound)
    bound.clear()
    repacked = logits(load_model(mixtral_q4_0, threads=1, repack=True))
    x86_avx2 = platform.machine().lower() in ("x86_64", "amd64") and \
        load_ggml().ggml_cpu_has_avx2()
    assert any(m.repacked for m in bound) or not x86_avx2
    assert tiny_models.relative_error(repacked, plain) <= 1e-3
    store = build_store(OffloadSettings(host_bytes=1 << 30))
    offloaded = logits(load_model(mixtral_q4_0, threads=1, repack=True, expert_runner=store))
    assert tiny_models.relative_error(offloaded, repacked) <= 1e-3
    assert torch.equal(offloaded.argmax(-1), repacked.argmax(-1))
