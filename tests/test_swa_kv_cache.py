"""Sliding-window layers keep only the positions they can still see, with unchanged logits.

Tiny Gemma 3, GPT-OSS and Gemma 4 models with a 5-token window run 40 tokens (the window is
crossed many times) with moeswap's trimming KVCache and with a cache that keeps every position
(``FullHistory`` below: ``attend`` over the whole key history, as before trimming). Logits must
agree within 1e-5 relative and in every argmax, for one-chunk prefill, token-by-token decode,
chunks longer and shorter than the window, and a batch of two sequences of different lengths.
A cache told the charged context and step sizes every layer's buffer to exactly what
``kv_cache_bytes`` charges (store, planner, server) and never grows past it; a step that fails
in a layer after others appended and is run again gives the reference logits; the planner's
llama.cpp KV counts the sliding cells llama.cpp allocates (window + micro-batch, padded).
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

import tiny_models
from moeswap.memory import held_positions, kv_bytes_per_token, kv_cache_bytes
from moeswap.formats.config import ModelConfig
from moeswap.models import KVCache, load_model

WINDOW = 5
N_TOKENS = 40
TOKENS = torch.randint(0, tiny_models.VOCAB, (N_TOKENS,),
                       generator=torch.Generator().manual_seed(3))
SWA_FAMILIES = ("gemma3", "gpt_oss", "gemma4")


class FullHistory:
    """A cache that keeps every position of every layer: the reference."""

    def __init__(self):
        self.length = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def append(self, layer, k, v):
        self.keys[layer] = torch.cat((self.keys[layer], k)) if layer in self.keys else k
        self.values[layer] = torch.cat((self.values[layer], v)) if layer in self.values else v
        return self.keys[layer], self.values[layer], torch.arange(self.keys[layer].shape[0])

    def advance(self, n_tokens):
        self.length += n_tokens


@pytest.fixture(scope="module", params=SWA_FAMILIES)
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = tiny_models.build(request.param, sliding_window=WINDOW)
    reference.save_pretrained(folder)
    model = load_model(folder)
    assert model.config.sliding_window == WINDOW and any(model.config.swa_layers)
    return request.param, reference, model


def run_chunks(model, cache, chunks: list[int]) -> torch.Tensor:
    """Feed TOKENS in chunks of these sizes; the logits of every position [N_TOKENS, V]."""
    out, at = [], 0
    for n in chunks:
        out.append(model.forward([TOKENS[at:at + n]], [cache])[0])
        at += n
    assert at == N_TOKENS
    return torch.cat(out)


def assert_same(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert tiny_models.relative_error(out, ref) <= 1e-5
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


SCHEDULES = {
    "one chunk": [N_TOKENS],
    "token by token": [1] * N_TOKENS,
    "chunks longer and shorter than the window": [3, 9, 2, 12, 1, 6, 7],
}


def buffer_slots(cache: KVCache, layer: int) -> int:
    """Positions layer's key buffer has room for (read from the buffer itself)."""
    return cache._layers[layer].keys.shape[0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trimmed_cache_gives_the_full_history_logits(family, schedule):
    _, _, model = family
    chunks = SCHEDULES[schedule]
    reference = run_chunks(model, FullHistory(), chunks)
    c = model.config
    cache = KVCache(c.layer_windows, N_TOKENS, max(chunks))
    assert_same(run_chunks(model, cache, chunks), reference)
    assert cache.length == N_TOKENS
    for layer, window in enumerate(c.layer_windows):  # sized once, to the charge
        assert buffer_slots(cache, layer) == held_positions(window, N_TOKENS, max(chunks))
    held = sum(s.keys.numel() + s.values.numel() for s in cache._layers)
    assert 4 * held == kv_cache_bytes(c, N_TOKENS, 1, max(chunks))
    assert_same(run_chunks(model, model.new_cache(), chunks), reference)  # no budget: grows


@pytest.mark.parametrize("chunks", [[1] * N_TOKENS, SCHEDULES["chunks longer and shorter than "
                                                              "the window"]])
def test_trimmed_cache_matches_transformers_past_the_window(family, chunks):
    _, reference, model = family
    expected = tiny_models.reference_logits(reference, TOKENS.tolist())
    assert tiny_models.relative_error(run_chunks(model, model.new_cache(), chunks), expected) <= 1e-4


def test_batch_of_two_sequences_of_different_lengths(family):
    """Two sequences in the same forwards: one 40 tokens long, one 23, at their own positions,
    each step a different chunk size for each."""
    _, _, model = family
    steps = [(7, 2), (1, 9), (12, 1), (1, 1), (6, 10), (13, 0)]  # tokens of (first, second)
    caches, refs = [model.new_cache(), model.new_cache()], [FullHistory(), FullHistory()]
    got, want = ([], []), ([], [])
    at = [0, 0]
    for sizes in steps:
        rows = [(i, TOKENS[at[i]:at[i] + n].flip(0) if i else TOKENS[at[i]:at[i] + n])
                for i, n in enumerate(sizes) if n]
        outs = model.forward([ids for _, ids in rows], [caches[i] for i, _ in rows])
        ref_outs = model.forward([ids for _, ids in rows], [refs[i] for i, _ in rows])
        for (i, ids), out, ref in zip(rows, outs, ref_outs):
            got[i].append(out)
            want[i].append(ref)
            at[i] += ids.numel()
    assert at == [N_TOKENS, 23]
    for i in range(2):
        assert_same(torch.cat(got[i]), torch.cat(want[i]))


def test_buffers_never_pass_the_charge(family):
    """The model sized by its budget (context 40, steps of up to 12): token-by-token decode
    after a 12-token prefill; every layer's buffer is what kv_cache_bytes charges, from the
    first append on (no growth, so never an old and a new buffer at once); the written
    slots end at the charge too."""
    _, _, model = family
    c = model.config
    model.context, model.step_tokens = N_TOKENS, 12
    try:
        cache = model.new_cache()
        run_chunks_from(model, cache, 0, [12])
        first = [cache._layers[layer].keys for layer in range(c.n_layer)]
        run_chunks_from(model, cache, 12, [1] * (N_TOKENS - 12))
    finally:
        model.context, model.step_tokens = 0, 0
    for layer, window in enumerate(c.layer_windows):
        assert cache._layers[layer].keys is first[layer]
        assert buffer_slots(cache, layer) == held_positions(window, N_TOKENS, 12)
    assert 4 * cache.n_floats() == kv_cache_bytes(c, N_TOKENS, step_tokens=12)
    assert kv_cache_bytes(c, N_TOKENS, step_tokens=12) < kv_bytes_per_token(c) * N_TOKENS


def run_chunks_from(model, cache, at: int, chunks: list[int]) -> list[torch.Tensor]:
    out = []
    for n in chunks:
        out.append(model.forward([TOKENS[at:at + n]], [cache])[0])
        at += n
    return out


class FailOnce:
    """Layer 1 as it runs, but the first call raises after the layer appended its keys."""

    def __init__(self, layer):
        self.layer, self.failed = layer, False

    def __call__(self, x, batch):
        out = self.layer(x, batch)
        if not self.failed:
            self.failed = True
            raise RuntimeError("out of memory (simulated)")
        return out


def test_a_step_failing_in_layer_1_and_run_again_gives_the_reference(family):
    """Layers 0 and 1 appended the failed step's keys, the others did not, the cache did not
    advance; the same step run again (it crosses the window and wraps the ring) and the rest
    give the full-history logits."""
    _, _, model = family
    chunks = SCHEDULES["chunks longer and shorter than the window"]
    reference = run_chunks(model, FullHistory(), chunks)
    cache = KVCache(model.config.layer_windows, N_TOKENS, max(chunks))
    got = run_chunks_from(model, cache, 0, chunks[:3])
    at = sum(chunks[:3])
    layer_1 = model.layers[1]
    model.layers[1] = FailOnce(layer_1)
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            model.forward([TOKENS[at:at + chunks[3]]], [cache])
        assert cache.length == at
        got += run_chunks_from(model, cache, at, chunks[3:])
    finally:
        model.layers[1] = layer_1
    assert_same(torch.cat(got), reference)


def test_a_step_run_again_after_a_failure_rewrites_its_slots():
    """A forward that fails after appending (the cache not advanced) and is run again with
    fewer tokens must not leave the failed step's keys visible at the same positions."""
    cache = KVCache([3])
    for pos in range(6):
        cache.append(0, torch.full((1, 1, 1), float(pos)), torch.zeros(1, 1, 1))
        cache.advance(1)
    cache.append(0, torch.full((4, 1, 1), -1.0), torch.zeros(4, 1, 1))  # fails before advance
    keys, _, positions = cache.append(0, torch.full((1, 1, 1), 6.0), torch.zeros(1, 1, 1))
    seen = sorted((int(p), float(k)) for k, p in zip(keys.flatten(), positions)
                  if 6 - 3 < p <= 6)
    assert seen == [(4, 4.0), (5, 5.0), (6, 6.0)]  # each visible position once


def tiny_config(**overrides) -> ModelConfig:
    """Gemma 3 pattern: layers 0-4 slide, layer 5 is global; 2 kv heads of 16: 64 numbers a
    layer per position (keys and values)."""
    fields = dict(arch="gemma3", n_vocab=32, n_embd=64, n_layer=6, n_head=4, n_head_kv=2,
                  n_ctx_train=256, rms_eps=1e-6, head_dim=16, sliding_window=8)
    return ModelConfig(**{**fields, **overrides})


def test_kv_cache_bytes_by_hand():
    c = tiny_config()
    assert c.kv_floats_per_token_by_kind == (64, 5 * 64)
    # full layer x context + sliding layers x min(context, window - 1 + step), float32
    assert kv_cache_bytes(c, 100, step_tokens=1) == 4 * (64 * 100 + 320 * 8) == 35840
    assert kv_cache_bytes(c, 100, step_tokens=16) == 4 * (64 * 100 + 320 * 23) == 55040
    assert kv_cache_bytes(c, 100, sequences=3, step_tokens=16) == 3 * 55040
    assert kv_cache_bytes(c, 5, step_tokens=1) == 4 * 384 * 5  # inside the window: all held
    assert kv_cache_bytes(c, 100) == 4 * 384 * 100 == kv_bytes_per_token(c) * 100  # one forward
    no_window = tiny_config(sliding_window=0)
    assert kv_cache_bytes(no_window, 100, step_tokens=1) == 4 * 384 * 100
    mla = ModelConfig(arch="deepseek2", n_vocab=32, n_embd=64, n_layer=3, n_head=4, n_head_kv=1,
                      n_ctx_train=256, rms_eps=1e-6, kv_lora_rank=32, n_rot=8)
    assert kv_cache_bytes(mla, 10, step_tokens=1) == 4 * 3 * 40 * 10


def test_gemma4_sliding_layers_have_their_own_heads():
    """Sliding layers 2 kv heads of 16, global 1 kv head of 32 with keys as values (still
    cached as values), window 4: a layer of each kind."""
    c = ModelConfig(arch="gemma4", n_vocab=32, n_embd=64, n_layer=2, n_head=4, n_head_kv=1,
                    n_ctx_train=256, rms_eps=1e-6, head_dim=32, head_dim_swa=16,
                    n_head_kv_swa=2, sliding_window=4, swa_layers=(True, False))
    assert kv_cache_bytes(c, 50, step_tokens=2) == 4 * (2 * 32 * 50 + 2 * 2 * 16 * 5)


def test_the_store_charges_the_trimmed_cache_and_a_steps_working_memory(tmp_path):
    """GPT-OSS tiny in Q8_0: layers 0 and 2 slide, layer 1 is global, 2 kv heads of 16."""
    from moeswap.experts.store import ExpertStore, shared_bytes
    from moeswap.experts.settings import OffloadSettings
    from moeswap.formats.config import config_from_gguf
    from moeswap.memory import HostCharge, forward_working_bytes
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.gguf_tools.convert import convert
    from moeswap.planner.sizes import model_sizes
    from moeswap.quant import CpuKernels

    tiny_models.save("gpt_oss", tmp_path / "hf", sliding_window=WINDOW)
    gguf = GGUFFile.open(convert(tmp_path / "hf", tmp_path / "model.q8_0.gguf", "q8_0"))
    config = config_from_gguf(gguf)
    assert config.swa_layers == (True, False, True)
    assert config.kv_floats_per_token_by_kind == (2 * 2 * 16, 2 * 2 * 2 * 16)
    charge = HostCharge.for_batch(1000, 3, 16)
    store = ExpertStore(gguf, CpuKernels(1), config.moe_layers, config.expert_act,
                        OffloadSettings(host_bytes=2**30), charge)
    r = store.residency
    assert r.charge["kv_bytes"] == 4 * 3 * (64 * 1000 + 128 * (WINDOW - 1 + 16)) == 798720
    working = forward_working_bytes(config, 16, 1000, 3)
    assert r.charged["host"] == (shared_bytes(gguf, config.moe_layers) + 798720 + working
                                 + r.staging.nbytes)
    sizes = model_sizes(gguf)  # the planner agrees
    assert sizes.host_charged(charge) == store.residency.charged["host"]
    assert sizes.host_terms(charge)["kv_bytes"] == store.residency.charge["kv_bytes"]


def test_a_model_loaded_with_the_store_sizes_its_caches_to_the_charge(tmp_path):
    """GPT-OSS tiny through load_model with the store charged for 50 positions fed 8 at a
    time: a new cache's buffers are the charged ones (full layer 50, sliding 4 + 8)."""
    from moeswap.experts.build import build_store
    from moeswap.experts.settings import OffloadSettings
    from moeswap.gguf_tools.convert import convert
    from moeswap.memory import HostCharge

    tiny_models.save("gpt_oss", tmp_path / "hf", sliding_window=WINDOW)
    path = convert(tmp_path / "hf", tmp_path / "model.q8_0.gguf", "q8_0")
    store = build_store(OffloadSettings(host_bytes=2**30), HostCharge.for_sequence(50, 8))
    model = load_model(path, expert_runner=store, context_tokens=50, step_tokens=8)
    cache = model.new_cache()
    model.forward([TOKENS[:3]], [cache])
    assert [buffer_slots(cache, layer) for layer in range(3)] == [WINDOW - 1 + 8, 50,
                                                                 WINDOW - 1 + 8]
    assert store.store.residency.charge["kv_bytes"] == 4 * sum(s.keys.numel() + s.values.numel()
                                           for s in cache._layers)


_KEEP_ALIVE: list = []  # llama.cpp keeps calling the log callback after the test


@pytest.mark.llama_cpp
def test_llama_cpp_keeps_the_window_and_a_micro_batch(tmp_path):
    """llama.cpp without --swa-full (llama-server's and llama-cli's default) gives sliding
    layers window + -ub 512 cells per sequence, padded to 256: the planner's llama.cpp KV
    counts the same cells and bytes."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                                    "(CI installs it)")
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.gguf_tools.convert import convert
    from moeswap.planner.llama_cpp import kv_bytes
    from moeswap.planner.placement import Budget
    from moeswap.planner.sizes import model_sizes

    tiny_models.save("gpt_oss", tmp_path / "hf", sliding_window=WINDOW)
    path = convert(tmp_path / "hf", tmp_path / "model.f32.gguf", "f32")
    sizes = model_sizes(GGUFFile.open(path))
    assert sizes.llama_cpp_swa_cells() == 768  # 5 + 512, padded to 256
    log: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user):
        log.append(text.decode(errors="replace"))

    _KEEP_ALIVE.append(collect)
    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    model = llama_cpp.llama_model_load_from_file(str(path).encode(),
                                                 llama_cpp.llama_model_default_params())
    assert model
    full, swa = sizes.config.kv_floats_per_token_by_kind
    for n_ctx, n_seq in [(4096, 1), (8192, 2)]:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx, n_seq
        params.swa_full = False  # the C API's default is a full-size cache; the tools' is not
        log.clear()
        context = llama_cpp.llama_init_from_model(model, params)
        assert context
        llama_cpp.llama_free(context)
        caches = [line for line in log if "llama_kv_cache: size =" in line]  # global, sliding
        cells = [int(re.search(r"\(\s*(\d+) cells", line).group(1)) for line in caches]
        mib = [float(re.search(r"size =\s+([\d.]+) MiB", line).group(1)) for line in caches]
        ctx = n_ctx // n_seq  # llama-server splits -c among -np slots
        assert cells == [ctx, 768]
        by_kind = [2 * n_seq * full * ctx, 2 * n_seq * swa * 768]  # f16 bytes
        assert all(abs(b / 2**20 - m) <= 0.0051 for b, m in zip(by_kind, mib))  # printed %.2f
        assert kv_bytes(sizes, Budget(0, 0, ctx, n_seq)) == sum(by_kind)
    llama_cpp.llama_model_free(model)
