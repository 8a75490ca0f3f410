"""GPT-OSS with MXFP4 routed experts, as published: computed from the stored bytes.

The tiny GPT-OSS is converted to f32, then its expert matrices are rewritten as MXFP4
(``mxfp4.gguf``) and, for reference, as the f32 values those MXFP4 bytes decode to
(``decoded.gguf``). moeswap runs the MXFP4 experts through ggml's kernels on the mapped bytes
(``QuantResidentExperts``: no float32 copy), which round each expert input row to Q8_0 first,
as llama.cpp does. So: moeswap and llama.cpp agree on both files; and moeswap on the MXFP4 file
equals moeswap on the decoded file once the decoded run's expert inputs are rounded to Q8_0 the
same way (that rounding is 3.0e-2 relative on this model's logits, whose clamped SwiGLU sees
large inputs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q, GGUFReader
from gguf.quants import dequantize, quantize

import tiny_models
from gguf_builders import rewrite_experts
from test_engine_families import float_runner
from moeswap.gguf_tools.convert import convert
from moeswap.models import load_model
from moeswap.models.experts import ACTIVATIONS, Expert, ResidentExperts
from moeswap.models.quant_experts import QuantResidentExperts

PROMPT = torch.randint(0, tiny_models.VOCAB, (16,), generator=torch.Generator().manual_seed(1))


def with_mxfp4_experts(source, path, as_mxfp4: bool):
    """Copy `source` with its expert matrices stored as MXFP4, or as MXFP4's decoded f32 values."""
    def stored(kind, data):
        packed = quantize(data, Q.MXFP4)
        if as_mxfp4:
            return packed, Q.MXFP4
        return dequantize(packed, Q.MXFP4).reshape(data.shape), Q.F32

    return rewrite_experts(source, path, stored)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tiny_models.save("gpt_oss", folder / "hf")
    f32 = convert(folder / "hf", folder / "model.f32.gguf", "f32")
    return (with_mxfp4_experts(f32, folder / "mxfp4.gguf", as_mxfp4=True),
            with_mxfp4_experts(f32, folder / "decoded.gguf", as_mxfp4=False))


def logits(model) -> torch.Tensor:
    return model.forward([PROMPT], [model.new_cache()])[0]


def q8_0_rounded(x: torch.Tensor) -> torch.Tensor:
    """x's rows as ggml feeds them to an MXFP4 dot product: rounded to Q8_0 blocks."""
    rows = x.detach().numpy().astype(np.float32)
    return torch.from_numpy(dequantize(quantize(rows, Q.Q8_0), Q.Q8_0).reshape(rows.shape))


def expert_with_q8_0_inputs(self, x, activation):
    h = ACTIVATIONS[activation](F.linear(q8_0_rounded(x), self.gate, self.gate_bias),
                                F.linear(q8_0_rounded(x), self.up, self.up_bias))
    return F.linear(q8_0_rounded(h), self.down, self.down_bias)


def test_mxfp4_experts_are_computed_from_their_bytes(files, monkeypatch):
    mxfp4_path, decoded_path = files
    model = load_model(mxfp4_path)
    assert isinstance(model.layers[0].ffn.experts, QuantResidentExperts)
    decoded = load_model(decoded_path, expert_runner=float_runner)  # torch's, to round below
    assert isinstance(decoded.layers[0].ffn.experts, ResidentExperts)
    out = logits(model)
    monkeypatch.setattr(Expert, "__call__", expert_with_q8_0_inputs)
    expected = logits(decoded)
    assert float((out - expected).abs().max() / expected.abs().max()) <= 1e-5


@pytest.mark.llama_cpp
def test_llama_cpp_agrees_on_mxfp4_experts(files):
    pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    from test_llama_cpp_logits import llama_cpp_logits
    from tiny_models import relative_error

    for path in files:
        ours = logits(load_model(path)).double().numpy()
        assert relative_error(ours, llama_cpp_logits(path)) <= 1e-4, path.name


def openai_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] float -> the published layout: blocks [E, out, in/32, 16], scales [E, out, in/32]
    (byte k of a block: element 2k in the low nibble, 2k+1 in the high), via ggml's quantizer."""
    ggml = torch.from_numpy(quantize(weight.numpy(), Q.MXFP4)).view(*weight.shape[:2], -1, 17)
    scales, qs = ggml[..., 0], ggml[..., 1:]  # qs byte j: element j (low), j+16 (high)
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [E, out, B, 32] in element order
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales.contiguous()


def test_published_mxfp4_folder_converts_byte_for_byte(tmp_path, files):
    """A GPT-OSS folder as OpenAI publishes it (MXFP4 *_blocks / *_scales) converts to the
    same MXFP4 bytes ggml's quantizer gives, without decoding; loaded directly, it computes
    those bytes as its converted file does."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    mxfp4_path, _ = files
    float_dir = mxfp4_path.parent / "hf"
    folder = tmp_path / "published"
    folder.mkdir()
    for f in float_dir.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(float_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = tensors.pop(name)  # [E, in, out]
        blocks, scales = openai_mxfp4(stored.transpose(1, 2).contiguous())
        # transformers' own decoder reads these as the values ggml's MXFP4 holds
        decoded = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
        packed = quantize(stored.transpose(1, 2).contiguous().numpy(), Q.MXFP4)
        assert torch.equal(decoded.transpose(1, 2), torch.from_numpy(
            dequantize(packed, Q.MXFP4).reshape(stored.transpose(1, 2).shape)))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, folder / "model.safetensors")

    converted = convert(folder, tmp_path / "published.gguf", "f32")
    assert torch.equal(logits(load_model(folder)), logits(load_model(converted)))
    ours = {t.name: t for t in GGUFReader(converted).tensors}
    expected = {t.name: t for t in GGUFReader(mxfp4_path).tensors}
    assert sorted(ours) == sorted(expected)
    for name, b in expected.items():
        a = ours[name]
        assert (a.tensor_type, list(a.shape)) == (b.tensor_type, list(b.shape)), name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), name
