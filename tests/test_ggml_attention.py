"""Attention as one ggml graph per layer (moeswap.models.ggml_attention) against llama.cpp and
against the torch reference (Attention's own code, load_model(graphs=False)).

The graph mirrors llama.cpp's attention without flash attention, slot spans padded as its n_kv
is, so on Q8_0 files the logits equal llama.cpp's bit for bit with an f32 and an f16 cache (the
torch reference parts from them by up to 9e-3, bounded at 1.5e-2, where an f16 rounding lands
the other way and the tiny model amplifies it). A piece, a step and a whole forward give the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_models
from moeswap.models import load_model
from moeswap.models.blocks import SLOT_SPAN

PROMPT = torch.randint(0, tiny_models.VOCAB, (40,), generator=torch.Generator().manual_seed(3))
# Families whose attention runs as a graph, and one that keeps the torch path per reason.
GRAPH_FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "olmoe", "granitemoe", "glm4moe", "gemma3")
# (MLA and Gemma 4 have graphs of their own: tests/test_sequence_graphs.py.)
TORCH_FAMILIES = {"gpt_oss": "sinks and YaRN"}


def graphs(model) -> list[bool]:
    return [getattr(layer, "graph", None) is not None for layer in model.layers]


def logits(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    return model.forward([ids], [cache if cache is not None else model.new_cache()])[0]


@pytest.mark.parametrize("family", GRAPH_FAMILIES)
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("repack", [False, True])
def test_every_layer_gets_a_graph_and_steps_equal_the_whole_forward(q8_files, family, kv_type,
                                                                    repack):
    """Decode steps give the whole forward's bits: as llama.cpp's graph, and with ``repack``
    with a kv head's query heads as one product's columns (moeswap.models.slot_attention; the
    tiny models have 4 heads, 2 kv heads; Q8_0 has no repacked layout on x86, so only the
    attention's layout differs)."""
    model = load_model(q8_files(family), kv_type=kv_type, repack=repack)
    assert all(graphs(model))
    whole = logits(model, PROMPT)
    cache = model.new_cache()
    steps = torch.cat([logits(model, PROMPT[i:i + 1], cache) for i in range(len(PROMPT))])
    # also past Gemma 3's 4-position windows (a ring)
    tiny_models.assert_same_bits(steps.numpy(), whole.numpy(), (family, kv_type))
    reference = load_model(q8_files(family), kv_type=kv_type, graphs=False)
    assert not any(graphs(reference))
    assert tiny_models.relative_error(whole, logits(reference, PROMPT)) < 1.5e-2
    assert torch.equal(whole.argmax(-1), logits(reference, PROMPT).argmax(-1))


@pytest.mark.parametrize("family", sorted(TORCH_FAMILIES))
def test_what_ggml_is_not_asked_keeps_the_torch_path(q8_files, family):
    assert not any(graphs(load_model(q8_files(family)))), TORCH_FAMILIES[family]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("family", ["mixtral", "qwen2moe", "qwen3moe", "olmoe", "granitemoe",
                                    "glm4moe"])
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_q8_0_logits_equal_llama_cpps_bit_for_bit(q8_files, family, kv_type):
    pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    path = q8_files(family)
    reference = tiny_models.llama_cpp_scores(path, PROMPT, {"f32": 0, "f16": 1}[kv_type])
    tiny_models.assert_same_bits(logits(load_model(path, kv_type=kv_type), PROMPT).numpy(),
                                 reference, (family, kv_type))


@pytest.mark.llama_cpp
def test_spans_of_slots_past_the_first(q8_files):
    """A budgeted cache (context 600) attends over 256-slot spans: at 300 positions the graph
    attends over two spans, as llama.cpp's n_kv, and the logits stay llama.cpp's bit for bit."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    ids = torch.randint(0, tiny_models.VOCAB, (300,), generator=torch.Generator().manual_seed(5))
    path = q8_files("mixtral")
    llm = llama_cpp.Llama(str(path), n_ctx=600, n_batch=64, logits_all=True, type_k=1,
                          type_v=1, flash_attn=False, n_threads=2, verbose=False)
    llm.eval(ids.tolist())
    reference = np.array(llm.scores[256:300], dtype=np.float32)
    model = load_model(path, kv_type="f16")
    model.context, model.step_tokens = 600, 64
    cache = model.new_cache()
    out = torch.cat([logits(model, ids[start:start + 64], cache) for start in range(0, 300, 64)])
    assert cache.length == 300 > SLOT_SPAN
    assert np.array_equal(out[256:].numpy(), reference)


@pytest.mark.parametrize("family", ["mixtral", "gemma3"])
def test_a_truncated_cache_continues_as_a_fresh_one(q8_files, family):
    """The server's prefix reuse: forget the last positions, feed others; masks hide the stale
    slots, so the result equals a cache that never saw them."""
    model = load_model(q8_files(family))
    other = torch.randint(0, tiny_models.VOCAB, (10,), generator=torch.Generator().manual_seed(9))
    cache = model.new_cache()
    logits(model, PROMPT[:3], cache)
    logits(model, torch.cat([PROMPT[3:6], other[:1]]), cache)
    assert cache.can_truncate(6)
    cache.truncate(6)
    reused = logits(model, PROMPT[6:12], cache)
    fresh = model.new_cache()
    logits(model, PROMPT[:6], fresh)
    assert torch.equal(reused, logits(model, PROMPT[6:12], fresh))


@pytest.mark.parametrize("family", ["gemma3", "qwen2moe"])
def test_dense_feed_forwards_run_as_one_graph(q8_files, family):
    """Gemma 3's GeGLU FFN and Qwen2-MoE's shared expert: the graph (moeswap.models.ggml_ffn)
    equals the torch path's three products and activation within a rounding."""
    model = load_model(q8_files(family))
    ffns = [getattr(layer.ffn, "shared", None) for layer in model.layers]
    ffns = [layer.ffn for layer in model.layers] if family == "gemma3" else [s.ffn for s in ffns]
    assert ffns and all(ffn.graph is not None for ffn in ffns)
    x = torch.randn(40, model.config.n_embd, generator=torch.Generator().manual_seed(2))
    for ffn in ffns:
        graph, ffn.graph = ffn.graph, None
        reference = ffn(x)
        ffn.graph = graph
        assert tiny_models.relative_error(ffn(x), reference) < 1e-5


@pytest.mark.parametrize("family", ["mixtral", "gemma3", "qwen2moe"])
def test_several_sequences_in_one_graph_equal_each_alone(q8_files, family):
    """Decode steps of several sequences run as one graph per layer (projections and routing
    batched, each sequence attending its own cache); each sequence's logits equal its own
    run's bit for bit, also when the batch's members change and when one feeds a long piece."""
    model = load_model(q8_files(family))
    prompts = [torch.randint(0, tiny_models.VOCAB, (n,), generator=torch.Generator().manual_seed(n))
               for n in (7, 11, 5)]
    alone = []
    for prompt in prompts:
        cache = model.new_cache()
        logits(model, prompt[:-2], cache)
        alone.append([logits(model, prompt[-2:-1], cache), logits(model, prompt[-1:], cache)])
    caches = [model.new_cache() for _ in prompts]
    first = model.forward([p[:-2] for p in prompts], caches)  # pieces of 5, 9, 3 together
    for prompt, cache, out in zip(prompts, caches, first):
        assert torch.equal(out, logits(model, prompt[:-2]))
    step = model.forward([p[-2:-1] for p in prompts], caches)
    assert all(torch.equal(out, own[0]) for out, own in zip(step, alone))
    step = model.forward([prompts[0][-1:], prompts[2][-1:]], [caches[0], caches[2]])
    assert torch.equal(step[0], alone[0][1]) and torch.equal(step[1], alone[2][1])
    long = torch.randint(0, tiny_models.VOCAB, (40,), generator=torch.Generator().manual_seed(4))
    mixed = model.forward([prompts[1][-1:], long], [caches[1], model.new_cache()])
    assert torch.equal(mixed[0], alone[1][1]) and torch.equal(mixed[1], logits(model, long))


def test_a_long_input_in_pieces_equals_it_fed_in_chunks(q8_files):
    """600 tokens go through 512 + 88-token graphs; fed as 100-token forwards they go through
    other pieces, and every logit is the same."""
    model = load_model(q8_files("mixtral"))
    ids = torch.randint(0, tiny_models.VOCAB, (600,), generator=torch.Generator().manual_seed(6))
    whole = logits(model, ids)
    cache = model.new_cache()
    chunks = torch.cat([logits(model, ids[i:i + 100], cache) for i in range(0, 600, 100)])
    assert torch.equal(whole, chunks)


def test_the_piece_for_a_large_cache_fits_the_scratch(q8_files):
    """A cache charged for 65,536 positions: the piece length chosen for it keeps the graph
    over the whole cache (scores, probabilities, mask, experts) inside the kernels' scratch:
    building that graph places every tensor, and raises past the scratch."""
    model = load_model(q8_files("mixtral"))
    model.context, model.step_tokens = 65536, 512
    spec = model.layers[0].attention.spec
    slots = model.new_cache().room(0, 512, (spec.n_head_kv, spec.head_dim),
                                   (spec.n_head_kv, spec.head_dim))
    graph = model.layers[0].graph
    n_tokens = graph._piece_tokens(slots)
    assert 1 <= n_tokens < 512
    _, context = graph._build([(slots, 0, n_tokens, slots.capacity)], fused=True)
    graph.ggml.ggml_free(context)


def test_sequences_whose_graph_would_not_fit_run_one_after_another(q8_files, monkeypatch):
    """Where several sequences' graph would outgrow the scratch they run one by one (here the
    limit is made tiny), giving the same bits as one graph for all."""
    from moeswap.models import ggml_attention

    prompts = [PROMPT[:5], PROMPT[5:14], PROMPT[14:17]]
    outputs, together = [], []
    for limit in (ggml_attention.GRAPH_BYTES, 1):
        monkeypatch.setattr(ggml_attention, "GRAPH_BYTES", limit)
        model = load_model(q8_files("mixtral"))
        model.token_graph = None  # the layer graphs' own batches (else one graph per step)
        caches = [model.new_cache() for _ in prompts]
        model.forward(prompts, caches)
        outputs.append(model.forward([p[-1:] for p in prompts], caches))
        together.append(len(model.layers[0].graph._batch_graphs))
    assert together[0] > 0 and together[1] == 0  # one graph for the three, then none
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_a_sequence_keeps_its_last_few_graphs(q8_files):
    """Pieces of many lengths against one cache: a layer keeps at most _SLOT_GRAPHS of that
    sequence's graphs (the oldest freed), and results stay those of a fresh model."""
    from moeswap.models import ggml_attention

    model = load_model(q8_files("mixtral"))
    model.token_graph = None  # else short steps run as one graph (tests/test_token_graph.py)
    cache = model.new_cache()
    ids = torch.randint(0, tiny_models.VOCAB, (66,), generator=torch.Generator().manual_seed(8))
    chunks, start = [], 0
    for n in range(1, 12):  # 11 piece lengths: 1 + 2 + ... + 11 = 66 tokens
        chunks.append(logits(model, ids[start:start + n], cache))
        start += n
    kept = model.layers[0].graph._graphs[cache._layers[0]]
    assert len(kept) == ggml_attention._SLOT_GRAPHS
    assert torch.equal(torch.cat(chunks), logits(load_model(q8_files("mixtral")), ids))


@pytest.mark.llama_cpp
def test_experts_share_one_product_where_a_tokens_bits_are_its_own(q8_files, tmp_path):
    """Q8_0 experts: a whole piece in one mul_mat_id (each expert's rows read once a piece, as
    llama.cpp), the same bits as the store's 32-token groups. Q4_K experts keep those groups
    under exact tiers (ggml's tiled K-quant path makes a token's product depend on its group)
    and share one product with repacked layouts on, within a logit tolerance."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python quantizes Q4_K_M")
    assert all(layer.graph.any_group for layer in load_model(q8_files("mixtral")).layers)
    path = tiny_models.q4_k_m_mixtral(tmp_path)
    exact, repacked = load_model(path), load_model(path, repack=True)
    assert not any(layer.graph.any_group for layer in exact.layers)
    assert all(layer.graph.any_group for layer in repacked.layers)
    ids = torch.randint(0, tiny_models.VOCAB, (64,), generator=torch.Generator().manual_seed(4))
    assert tiny_models.relative_error(logits(repacked, ids), logits(exact, ids)) < 1e-2
