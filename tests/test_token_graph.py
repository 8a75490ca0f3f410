"""One graph per step (moeswap.models.token_graph) against the same layers run one graph each.

A step of one sequence of at most PIECE_TOKENS new tokens runs every layer's nodes, the final
norm and the head as one ggml graph: the logits, the cache it writes and the routing it reports
are those of the layer-by-layer path, bit for bit (that path equals llama.cpp's logits on Q8_0
files: tests/test_ggml_attention.py).
"""

from __future__ import annotations

import pytest
import torch

import tiny_models
from moeswap.gguf_tools.convert import convert
from moeswap.models import load_model, token_graph
from moeswap.models.ggml_attention import PIECE_TOKENS
from moeswap.quant import CpuKernels
from test_expert_store import store_model

# Heads of 32 numbers (one Q8_0 block), so that a Q8_0 cache takes them too.
FAMILIES = {"mixtral": {"head_dim": 32}, "qwen3moe": {}, "olmoe": {"hidden_size": 128},
            "granitemoe": {"hidden_size": 128},
            "gemma3": {"head_dim": 32, "query_pre_attn_scalar": 32}}
IDS = torch.randint(0, tiny_models.VOCAB, (300,), generator=torch.Generator().manual_seed(5))


class Calls:
    """Counts graph computes (CpuKernels.run)."""

    def __init__(self, monkeypatch):
        self.count, run = 0, CpuKernels.run

        def counted(kernels, *args, **kwargs):
            self.count += 1
            return run(kernels, *args, **kwargs)
        monkeypatch.setattr(CpuKernels, "run", counted)


class Decisions:
    """A routing recorder keeping every layer's (layer, ids, weights)."""

    router_probs = False

    def __init__(self):
        self.records = []

    def begin_forward(self, spans, starts, sequences) -> None:
        pass

    def record(self, layer, ids, weights, probs) -> None:
        self.records.append((layer, ids.clone(), weights.clone()))


def steps(model, lengths, last_only_at=()) -> torch.Tensor:
    """Feed IDS in pieces of ``lengths`` to one cache -> every piece's logits, concatenated
    (the last row alone for the pieces numbered in last_only_at)."""
    cache, out, start = model.new_cache(), [], 0
    for i, n in enumerate(lengths):
        out.append(model.forward([IDS[start:start + n]], [cache], last_only=i in last_only_at)[0])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_as_one_graph_equals_the_layers_one_by_one(q8_files, family, kv_type):
    """Prefill in pieces of up to 32, decode past Gemma 3's rings and past a slot span (256
    positions), a last-row-only step: the same bits as with the token graph off."""
    model = load_model(q8_files(family, **FAMILIES[family]), kv_type=kv_type)
    assert model.token_graph is not None
    lengths = [PIECE_TOKENS] * 8 + [7, 3] + [1] * 34
    fast = steps(model, lengths, last_only_at={9})
    model.token_graph = None
    assert torch.equal(fast, steps(model, lengths, last_only_at={9}))


def test_a_decode_step_is_one_compute_and_longer_steps_go_layer_by_layer(q8_files, monkeypatch):
    model = load_model(q8_files("mixtral", **FAMILIES["mixtral"]))
    calls, cache = Calls(monkeypatch), model.new_cache()
    model.forward([IDS[:PIECE_TOKENS]], [cache])
    model.forward([IDS[PIECE_TOKENS:PIECE_TOKENS + 1]], [cache])
    assert calls.count == 2  # one prompt piece, one decode step: one graph each
    model.forward([IDS[:PIECE_TOKENS + 1]], [model.new_cache()])  # over PIECE_TOKENS
    assert calls.count == 2 + 1 + len(model.layers) + 2  # lookup, layers, the head's 2 groups
    calls.count = 0
    model.forward([IDS[:1], IDS[1:3]], [model.new_cache(), model.new_cache()])
    assert calls.count == 1  # two sequences: one graph too


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("family", ["mixtral", "gemma3"])
def test_several_sequences_in_one_graph_equal_the_layers_one_by_one(q8_files, family, kv_type):
    """Three sequences at different lengths (one past a slot span, Gemma 3's rings wrapped),
    prompt pieces beside decode steps, all rows and the last rows only."""
    def run(model) -> list[torch.Tensor]:
        caches, out = [model.new_cache() for _ in range(3)], []
        for i, cache in enumerate(caches):  # 5, 270 and 40 positions
            for start in range(0, (5, 270, 40)[i], PIECE_TOKENS):
                model.forward([IDS[start:min(start + PIECE_TOKENS, (5, 270, 40)[i])]], [cache])
        for step in range(6):
            ids = [IDS[step:step + 1], IDS[step:step + 1 + step % 3], IDS[7:8]]
            out += model.forward(ids, caches, last_only=step % 2 == 1)
        return out

    model = load_model(q8_files(family, **FAMILIES[family]), kv_type=kv_type)
    fast = run(model)
    model.token_graph = None
    assert all(torch.equal(a, b) for a, b in zip(fast, run(model)))


def test_routing_reported_as_layer_by_layer(q8_files):
    runs = []
    for use_graph in (True, False):
        decisions = Decisions()
        model = load_model(q8_files("mixtral", **FAMILIES["mixtral"]), recorder=decisions)
        if not use_graph:
            model.token_graph = None
        steps(model, [5, 1, 1])
        runs.append(decisions.records)
    assert [layer for layer, *_ in runs[0]] == [layer for layer, *_ in runs[1]]
    assert len(runs[0]) == 3 * len(model.layers)
    for (_, ids, weights), (_, ids_ref, weights_ref) in zip(*runs):
        assert torch.equal(ids, ids_ref.to(ids.dtype)) and torch.equal(weights, weights_ref)


def test_the_model_keeps_its_last_few_graphs(q8_files):
    """11 step shapes on two caches: the model keeps the last _KEPT graphs whichever cache
    they write (their contexts hold every node: bounded per model, not per cache)."""
    model = load_model(q8_files("mixtral", **FAMILIES["mixtral"]))
    caches, chunks, start = [model.new_cache(), model.new_cache()], [], 0
    for n in range(1, 12):
        chunks.append(model.forward([IDS[start:start + n]], [caches[n % 2]])[0])
        start += n
    assert len(model.token_graph._kept) == token_graph._KEPT
    fresh = load_model(q8_files("mixtral", **FAMILIES["mixtral"]))
    again, start = [fresh.new_cache(), fresh.new_cache()], 0
    for n, chunk in zip(range(1, 12), chunks):
        assert torch.equal(chunk, fresh.forward([IDS[start:start + n]], [again[n % 2]])[0])
        start += n


def test_models_whose_ffn_leaves_the_layer_graph_run_layer_by_layer(q8_files, tmp_path):
    mixtral = q8_files("mixtral", **FAMILIES["mixtral"])
    assert load_model(mixtral, graphs=False).token_graph is None
    offloaded, _ = store_model(q8_files("mixtral", **FAMILIES["mixtral"]),
                               host_slots=4)  # experts in the store
    assert offloaded.token_graph is None and offloaded.head_graph is not None
    tiny_models.save("deepseek2", tmp_path / "hf")  # MLA keeps torch attention
    path = convert(tmp_path / "hf", tmp_path / "model.q8_0.gguf", "q8_0")
    assert load_model(path).token_graph is None


@pytest.mark.parametrize("n_ids", [1, 64, 65, 300])
def test_token_ids_outside_the_vocabulary_are_refused_before_ggml(q8_files, n_ids):
    """ggml's lookup would abort the process on an id outside its table: a short step's ids
    (checked in Python) and a long one's (one numpy reduction) both raise ValueError, at either
    end, through the token graph and the layer-by-layer path; the cache is left as it was."""
    model = load_model(q8_files("mixtral", **FAMILIES["mixtral"]))
    cache = model.new_cache()
    for bad in (-1, tiny_models.VOCAB):
        ids = IDS[:n_ids].clone()
        ids[n_ids // 2] = bad
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {tiny_models.VOCAB}\)"):
            model.forward([ids], [cache])
        assert cache.length == 0
    assert model.forward([IDS[:n_ids]], [cache])[0].shape == (n_ids, tiny_models.VOCAB)
