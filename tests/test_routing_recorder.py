"""RoutingRecorder and `moeswap trace`: the recorded experts are the router's real choices (checked
against transformers' own router logits of the same tiny models), prompt boundaries and phases,
a batch of sequences split back into its prompts, logits unchanged bit for bit, and the command
line from `moeswap trace` to `moeswap stats`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tiny_models
from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.models import load_model
from moeswap.trace_capture import Prompt, read_prompts, record_trace
from moeswap.routing.recorder import RoutingRecorder
from moeswap.routing.traces import PHASES
from moeswap.runtime import load

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world", "def add(a, b): return a + b"]
NEW_TOKENS = 5
PREFILL, DECODE = PHASES.index("prefill"), PHASES.index("decode")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (HF folder, the transformers model saved there)."""
    root = tmp_path_factory.mktemp("recorder")
    return {f: (root / f, tiny_models.save(f, root / f)) for f in ("mixtral", "deepseek2", "gemma4")}


def greedy_rows(folder, texts, new_tokens):
    """Per prompt, the ids the engine runs when tracing: the prompt, then its greedy continuation."""
    runtime = load(folder)
    return [runtime.encode(t) + list(runtime.generate(t, new_tokens, temperature=0.0, stop_ids=frozenset()))
            for t in texts]


def reference_routing(hf_model, ids, k, normalize, scale):
    """transformers' router on ``ids`` (one full forward): per MoE layer (ids, weights, probs) [T, .]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids]), output_router_logits=True).router_logits
    out = []
    for layer_logits in logits:
        probs = torch.softmax(layer_logits.float(), dim=-1)  # [T, E]
        weights, chosen = torch.topk(probs, k, dim=-1)  # [T, k]
        if normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        out.append((chosen.numpy(), (weights * scale).numpy(), probs.numpy()))
    return out


@pytest.mark.parametrize("family, normalize, scale", [("mixtral", True, 1.0), ("deepseek2", False, 2.5)])
def test_recorded_experts_are_what_the_router_chose(folders, family, normalize, scale):
    folder, hf_model = folders[family]
    trace = record_trace(folder, [Prompt(f"p{i}", t) for i, t in enumerate(TEXTS)], new_tokens=NEW_TOKENS,
                         router_probs=True, stop_ids=frozenset())
    k = hf_model.config.num_experts_per_tok
    assert trace.layers.tolist() == ([0, 1] if family == "mixtral" else [1, 2])  # DeepSeek's layer 0 is dense
    margins = []
    for p, ids in enumerate(greedy_rows(folder, TEXTS, NEW_TOKENS)):
        rows = slice(trace.prompt_offsets[p], trace.prompt_offsets[p + 1])
        assert rows.stop - rows.start == len(ids)
        reference = reference_routing(hf_model, ids, k, normalize, scale)
        for column, (chosen, weights, probs) in enumerate(reference):
            recorded = trace.expert_ids[rows, column]
            # Two engines agree to ~1e-6; only a near-tie between the k-th and next expert may flip.
            ordered = np.sort(probs, axis=-1)[:, ::-1]
            margin = ordered[:, k - 1] - ordered[:, k]
            margins.append(margin.min())
            clear = margin > 1e-4
            np.testing.assert_array_equal(recorded[clear], chosen[clear])
            np.testing.assert_allclose(trace.weights[rows, column][clear], weights[clear],
                                       rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(trace.router_probs[rows, column].astype(np.float32), probs, atol=1e-3)
    assert min(margins) > 1e-4, "a near-tie hid a row from the check; pick other texts"


def test_prompt_boundaries_phases_and_batches(folders):
    folder, hf_model = folders["deepseek2"]
    prompts = [Prompt(f"p{i}", t) for i, t in enumerate(TEXTS)]
    batched = record_trace(folder, prompts, new_tokens=NEW_TOKENS, stop_ids=frozenset(), batch_size=8)
    one_by_one = record_trace(folder, prompts, new_tokens=NEW_TOKENS, stop_ids=frozenset(), batch_size=1)
    lengths = [len(load(folder).encode(t)) for t in TEXTS]
    assert batched.prompt_offsets.tolist() == np.cumsum([0] + [n + NEW_TOKENS for n in lengths]).tolist()
    assert batched.prompt_names == ["p0", "p1", "p2"]
    expected_phase = np.concatenate([[PREFILL] * n + [DECODE] * NEW_TOKENS for n in lengths])
    np.testing.assert_array_equal(batched.phase, expected_phase)
    assert (batched.arch, batched.n_experts, batched.k, batched.model) == ("deepseek2", 8, 3, "deepseek2")
    assert batched.valid.all() and batched.router_probs is None
    # The batch's rows go back to their own prompts: the same as running each prompt alone.
    np.testing.assert_array_equal(batched.expert_ids, one_by_one.expert_ids)
    np.testing.assert_array_equal(batched.phase, one_by_one.phase)


def test_a_stop_token_ends_the_prompts_rows_early(folders):
    folder, _ = folders["mixtral"]
    ids = greedy_rows(folder, TEXTS, 6)
    # A prompt whose greedy continuation has a token not seen before it, after the first.
    p, j = next((p, j) for p, row in enumerate(ids) for j in range(1, 6)
                if row[-6 + j] not in row[-6:-6 + j])
    stop = ids[p][-6 + j]
    trace = record_trace(folder, [Prompt("x", TEXTS[p])], new_tokens=6, stop_ids=frozenset({stop}))
    n_prompt = len(ids[p]) - 6
    assert trace.prompt_offsets.tolist() == [0, n_prompt + j]  # j tokens run; the stop is not
    assert trace.phase.tolist() == [PREFILL] * n_prompt + [DECODE] * j


@pytest.mark.parametrize("family", ["mixtral", "deepseek2", "gemma4"])
def test_recording_leaves_logits_bitwise_unchanged(folders, family):
    folder, _ = folders[family]
    recorder = RoutingRecorder(router_probs=True)
    plain, recorded = load_model(folder), load_model(folder, recorder=recorder)
    prompts = [torch.tensor([1, 5, 9, 17, 33]), torch.tensor([1, 64, 7])]
    outputs = []
    for model in (plain, recorded):
        caches = [model.new_cache() for _ in prompts]
        steps = [model.forward(prompts, caches)]
        for token in (3, 11, 40):
            steps.append(model.forward([torch.tensor([token]), torch.tensor([token + 1])], caches))
        outputs.append([row for step in steps for row in step])
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
    assert recorder.n_sequences == 2


class FakeCache:
    pass


def test_recorder_tells_sequences_apart_by_cache_and_names_phases():
    recorder = RoutingRecorder()
    a, b = FakeCache(), FakeCache()
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    w = torch.full((5, 2), 0.5)
    recorder.begin_forward([(0, 3), (3, 5)], [0, 0], [a, b])  # prefill of 3 and 2 tokens
    recorder.record(4, ids, w, None)
    recorder.begin_forward([(0, 1), (1, 3)], [3, 2], [a, b])  # a decodes one; b prefills a chunk of 2
    recorder.record(4, ids[:3].flip(0), w[:3], None)
    recorder.begin_forward([(0, 1)], [0], [a])  # a's cache at 0 again: a new sequence
    recorder.record(4, ids[:1], w[:1], None)
    trace = recorder.trace(model="m", arch="llama", layers=[4], n_experts=4, k=2,
                           prompt_names=["x", "y", "z"])
    assert trace.prompt_offsets.tolist() == [0, 4, 8, 9]
    assert trace.expert_ids[:, 0].tolist() == [[0, 1], [1, 2], [2, 3], [2, 3],  # x: 3 + 1 decoded
                                               [3, 0], [0, 2], [1, 2], [0, 1],  # y: 2 + a chunk of 2
                                               [0, 1]]  # z
    assert [PHASES[p] for p in trace.phase] == ["prefill"] * 3 + ["decode"] + ["prefill"] * 5
    with pytest.raises(ValueError, match="2 prompt names for 3 recorded sequences"):
        recorder.trace(model="m", arch="llama", layers=[4], n_experts=4, k=2, prompt_names=["x", "y"])
    recorder.clear()
    assert recorder.trace(model="m", arch="llama", layers=[4], n_experts=4, k=2).n_tokens == 0


def test_trace_then_stats_through_the_command_line(folders, tmp_path, capsys):
    folder, _ = folders["mixtral"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{TEXTS[0]}\n\n{TEXTS[1]}\n")
    out = tmp_path / "trace.npz"
    assert main(["trace", str(folder), "--prompts", str(prompts), "-o", str(out), "-n", "4",
                 "--router-probs"]) == 0
    runtime = load(folder)
    rows = [len(runtime.encode(t)) + len(list(runtime.generate(t, 4, temperature=0.0))) for t in TEXTS[:2]]
    assert capsys.readouterr().out.strip() == \
        f"wrote {out}: {sum(rows)} tokens, 2 prompts, 2 layers, 4 experts, top-2"
    assert main(["stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["n_tokens"], stats["n_prompts"], stats["layers"], stats["k"]) == (sum(rows), 2, [0, 1], 2)
    assert [sum(c) for c in stats["counts"]] == [2 * sum(rows)] * 2  # every token's 2 choices, per layer
    from moeswap.routing.traces import RoutingTrace

    trace = RoutingTrace.load(out)
    assert trace.prompt_names == ["prompts.txt:1", "prompts.txt:3"]
    assert trace.router_probs.shape == (sum(rows), 2, 4)


def test_trace_command_errors_are_one_line(folders, tmp_path, capsys):
    folder, _ = folders["mixtral"]
    out = str(tmp_path / "t.npz")
    assert main(["trace", str(folder), "--prompts", str(tmp_path / "none.txt"), "-o", out]) == 2
    assert capsys.readouterr().err.strip() == f"moeswap: error: {tmp_path / 'none.txt'}: no such prompts file"
    assert main(["trace", str(folder), "-p", "hi", "-o", out, "-n", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "moeswap: error: tokens to generate must be >= 0, got -1"


def test_jsonl_prompts_and_their_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "one\\ntwo", "name": "multi"}\n{"prompt": "three"}\n')
    assert read_prompts(good) == [Prompt("multi", "one\ntwo"), Prompt("p.jsonl:2", "three")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(MoeswapError, match=r"bad.jsonl:1: expected a JSON object with a \"prompt\""):
        read_prompts(bad)
