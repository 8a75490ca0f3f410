"""The IQ1-IQ3 quantizations end to end, on a small Mixtral-shaped MoE (256-wide rows, so every
matrix is a whole number of 256-value blocks).

Files are made two ways. llama.cpp's own quantizer (``llama_model_quantize``) makes IQ3_S and
IQ3_M (IQ3_S mixed with Q4_K and Q6_K), the IQ mixes it quantizes without an importance matrix.
Every other IQ1-IQ3 ftype it refuses without one ("this quantization requires an importance
matrix", even IQ3_XXS, whose mix puts attn_k in IQ2_S), and its ``imatrix`` parameter is a C++
map that ctypes cannot build; so for every type the attention and expert matrices are also
quantized here by ggml's quantizer (``quantize_rows``) with a *uniform* importance matrix (all
ones: every input column weighted alike) and written by gguf-py's writer; embeddings, router,
norms and head stay F32, as llama.cpp keeps routers.

Each file is held (a) to a naive float64 forward of its own weights dequantized by gguf-py
(tests/test_quant_forward.py), by the median over positions of the logits' NMSE, and (b) to
llama.cpp on the same file, as a peer, by that median and the share of positions whose argmax
agree. A low-bit router flips near-ties: with IQ2_S and IQ3_XXS one position's top-2 differs
from the float64 forward's (NMSE 8.8e-3 and 1.1e-2 there, ~1e-4 before it, ~5e-4 after it
through the KV cache; this random model's logits are nearly flat, so the forward's argmax then
differs at a position or two), while llama.cpp, on the same ggml kernels, makes exactly
moeswap's choices (median NMSE ~6e-14 on the files quantized here, bit-identical logits on
llama.cpp's own IQ3_S and IQ3_M files). A split IQ2_XXS set gives exactly its single-file
twin's results in moeswap and in llama.cpp.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFReader

import tiny_models
from split_builders import rewrite, split_copy
from test_quant_forward import PROMPT, naive_mixtral_logits

from moeswap.cli import main
from moeswap.formats.gguf_file import GGUFFile
from moeswap.gguf_tools.convert import convert
from moeswap.gguf_tools.doctor import diagnose
from moeswap.gguf_tools.inspect import inspect_file
from moeswap.models import load_model
from moeswap.planner.sizes import model_sizes
from moeswap.quant.kernels import needs_importance, quantize_rows

llama_cpp = pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
pytestmark = pytest.mark.llama_cpp

IQ_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
# llama_ftype values llama.cpp quantizes unaided, and the IQ type each must produce.
LLAMA_FTYPES = {"IQ3_S": (26, "IQ3_S"), "IQ3_M": (27, "IQ3_S")}
# Median NMSE over positions against the float64 forward: ~1e-4 where the routers agree, but a
# flip at position 7 of 16 (IQ2_S) leaves every later position ~5e-4 off through the KV cache,
# so the median sits at the flip's level; the bound is 4x that. Against llama.cpp (median NMSE,
# share of equal argmax): measured 0 to 7e-14, and every argmax.
NAIVE_MEDIAN_NMSE, PEER_BOUNDS = 2e-3, (1e-8, 0.9)


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    tiny_models.save("mixtral", folder / "hf", hidden_size=256, intermediate_size=256,
                     initializer_range=0.02)
    return convert(folder / "hf", folder / "model.f32.gguf", "f32")


def quantized_here(qtype: Q):
    """rewrite()'s callback: attention and expert matrices as ``qtype``, the rest unchanged."""
    def restore(name: str, rows: np.ndarray):
        if not name.startswith("blk.") or "norm" in name or "gate_inp" in name:
            return None
        importance = np.ones(rows.shape[1], np.float32) if needs_importance(qtype) else None
        return quantize_rows(rows, qtype, importance), qtype
    return restore


def llama_cpp_logits(path) -> np.ndarray:
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, type_k=0, type_v=0,
                          flash_attn=False, n_threads=2, verbose=False)
    llm.eval(PROMPT.tolist())
    return np.array(llm.scores[: len(PROMPT)], dtype=np.float64)


def moeswap_logits(path) -> np.ndarray:
    model = load_model(path)
    return model.forward([PROMPT], [model.new_cache()])[0].double().numpy()


def peer_agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(median over positions of the NMSE, share of positions with the same argmax)."""
    nmse = ((ours - theirs) ** 2).mean(axis=1) / (theirs ** 2).mean(axis=1)
    return float(np.median(nmse)), float((ours.argmax(1) == theirs.argmax(1)).mean())


def types_in(path) -> set[str]:
    return {t.tensor_type.name for t in GGUFReader(path).tensors}


def check_file(path, label: str) -> None:
    ours = moeswap_logits(path)
    naive = peer_agreement(ours, naive_mixtral_logits(path, PROMPT.tolist()).numpy())
    peer = peer_agreement(ours, llama_cpp_logits(path))
    print(f"{label}: naive {naive[0]:.1e} / {naive[1]:.2f}, "
          f"llama.cpp {peer[0]:.1e} / {peer[1]:.2f}")
    assert naive[0] <= NAIVE_MEDIAN_NMSE, naive
    assert peer[0] <= PEER_BOUNDS[0] and peer[1] >= PEER_BOUNDS[1], peer


@pytest.mark.parametrize("name", IQ_TYPES)
def test_quantized_here_matches_the_naive_forward_and_llama_cpp(f32_file, tmp_path, name):
    path = rewrite(f32_file, tmp_path / f"model.{name}.gguf", restore=quantized_here(Q[name]))
    assert name in types_in(path)
    check_file(path, f"{name} quantized here")


@pytest.mark.parametrize("name", sorted(LLAMA_FTYPES))
def test_quantized_by_llama_cpp_matches_the_naive_forward_and_llama_cpp(f32_file, tmp_path, name):
    ftype, expected_type = LLAMA_FTYPES[name]
    path = tiny_models.llama_cpp_quantized(f32_file, tmp_path / f"model.{name}.gguf", ftype)
    assert expected_type in types_in(path)
    check_file(path, f"{name} quantized by llama.cpp")


# An "UD"-style mix, as the low-bit DeepSeek / Kimi files are built: gate and up experts in
# IQ1_S, down experts in IQ2_XXS, attention in Q4_K.
UD_MIX = {"ffn_gate_exps": Q.IQ1_S, "ffn_up_exps": Q.IQ1_S, "ffn_down_exps": Q.IQ2_XXS,
          "attn_": Q.Q4_K}


def ud_mix(name: str, rows: np.ndarray):
    qtype = next((t for part, t in UD_MIX.items() if f".{part}" in name), None)
    return None if qtype is None else quantized_here(qtype)(name, rows)


def test_a_ud_style_mix_runs_exactly_through_the_expert_store(f32_file, tmp_path):
    from test_expert_store import decode_logits, store_model

    from moeswap.models.quant_experts import QuantResidentExperts

    path = rewrite(f32_file, tmp_path / "ud.gguf", restore=ud_mix)
    assert {"IQ1_S", "IQ2_XXS", "Q4_K"} <= types_in(path)
    check_file(path, "UD-style mix")
    expected = decode_logits(load_model(path, threads=1, expert_runner=QuantResidentExperts))
    model, factory = store_model(path, 2)  # two host slots for 8 experts
    assert torch.equal(decode_logits(model), expected)
    assert factory.stats()["total"]["disk_misses"] > 0


@pytest.fixture(scope="module")
def iq2_xxs_set(f32_file):
    """(first piece of a 4-piece IQ2_XXS set, its single-file twin)."""
    single = rewrite(f32_file, f32_file.with_name("twin.gguf"), restore=quantized_here(Q.IQ2_XXS))
    return split_copy(single, f32_file.with_name("set.gguf"), 4), single


def test_a_split_iq2_xxs_set_gives_its_single_file_twins_results(iq2_xxs_set, capsys):
    first, single = iq2_xxs_set
    assert np.array_equal(moeswap_logits(first), moeswap_logits(single))
    assert np.array_equal(llama_cpp_logits(first), llama_cpp_logits(single))
    assert diagnose(first).findings == []
    a, b = inspect_file(first), inspect_file(single)
    assert (a.totals, a.type_mix, a.layers) == (b.totals, b.type_mix, b.layers)
    assert "IQ2_XXS" in a.type_mix and len(a.pieces) == 4
    whole, one = GGUFFile.open(first), GGUFFile.open(single)
    assert model_sizes(whole).routed_bytes == model_sizes(one).routed_bytes
    whole.close()
    one.close()
    reports = []
    for path in (first, single):
        assert main(["plan", str(path), "--host-mem", "64MiB", "-c", "256", "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0]["bytes"] == reports[1]["bytes"]
    texts = []
    for path in (first, single):  # through the expert store, reading experts from the pieces
        assert main(["run", str(path), "-p", "hello", "-n", "6", "--temp", "0", "--threads", "1",
                     "--host-mem", "2MiB"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()


def test_serve_answers_the_same_from_the_split_set(iq2_xxs_set):
    import moeswap
    from fastapi.testclient import TestClient

    from moeswap.server.app import ServerOptions, create_app
    from moeswap.server.batching import BatchOptions

    bodies = []
    for path in iq2_xxs_set:
        runtime = moeswap.load(path, threads=1, tokenizer_cache_dir=path.parent / "cache")
        options = ServerOptions("tiny", BatchOptions(max_batch=2, queue_size=4, ctx=64))
        with TestClient(create_app(runtime, options), base_url="http://127.0.0.1") as client:
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello",
                                                     "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        bodies.append(r.json()["choices"])
    assert bodies[0] == bodies[1] and bodies[0][0]["text"]
