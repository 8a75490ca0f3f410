"""Prefill + decode against a tiny fake model whose next token is known in closed form."""

from __future__ import annotations

import re

import pytest
import torch

from moeswap.errors import MoeswapError
from moeswap.generate import GenerationStats, generate, generate_batch
from moeswap.sampling import Sampler, SamplingParams

V = 11


class FakeCache:
    def __init__(self):
        self.tokens: list[int] = []


class SumModel:
    """Next token = (sum of all tokens so far) * 3 mod V, as a sharp peak in the logits.
    It keeps its state only in the caches, so a forgotten or mixed-up cache shows."""

    def __init__(self):
        self.calls: list[list[int]] = []  # tokens per sequence of each forward call

    def new_cache(self):
        return FakeCache()

    def forward(self, tokens, caches, last_only=False):
        self.calls.append([int(t.numel()) for t in tokens])
        out = []
        for ids, cache in zip(tokens, caches):
            rows = []
            for token in ids.tolist():
                cache.tokens.append(token)
                logits = torch.zeros(V)
                logits[sum(cache.tokens) * 3 % V] = 10.0
                logits[(sum(cache.tokens) * 3 + 1) % V] = 9.0
                rows.append(logits)
            out.append(torch.stack(rows))
        return out


def expected_greedy(prompt, n, stop=()):
    ids, out = list(prompt), []
    for _ in range(n):
        token = sum(ids) * 3 % V
        if token in stop:
            break
        ids.append(token)
        out.append(token)
    return out


def test_greedy_continuation_and_one_token_per_decode_step():
    model = SumModel()
    stats = GenerationStats()
    tokens = list(generate(model, [1, 2, 3], max_tokens=6, stats=stats))
    assert tokens == expected_greedy([1, 2, 3], 6)
    assert model.calls == [[3]] + [[1]] * 5  # prefill, then 5 decodes (the 6th token needs none)
    assert (stats.prompt_tokens, stats.decode_tokens, stats.generated_tokens) == (3, 5, 6)
    assert stats.finish_reasons == ["length"]
    assert stats.prompt_seconds > 0 and stats.decode_seconds > 0


def test_stop_token_ends_generation_and_is_not_yielded():
    full = expected_greedy([4], 8)
    stop = full[3]
    stats = GenerationStats()
    tokens = list(generate(SumModel(), [4], max_tokens=8, stop_ids=frozenset({stop}), stats=stats))
    assert tokens == full[:3]
    assert stats.finish_reasons == ["stop"]


def test_zero_max_tokens_runs_nothing():
    model = SumModel()
    assert list(generate(model, [1], max_tokens=0)) == []
    assert model.calls == []


def test_empty_prompt_is_an_error():
    with pytest.raises(MoeswapError, match="empty prompt"):
        list(generate(SumModel(), [], max_tokens=3))


def test_batch_of_different_lengths_equals_single_runs():
    prompts = [[1], [2, 5, 7, 1], [3, 3]]
    stops = frozenset({expected_greedy([3, 3], 10)[2]})  # the third sequence stops early
    model = SumModel()
    stats = GenerationStats()
    produced: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step in generate_batch(model, prompts, max_tokens=5, stop_ids=stops, stats=stats):
        for index, token in step:
            produced[index].append(token)
    for index, prompt in enumerate(prompts):
        assert produced[index] == expected_greedy(prompt, 5, stops), index
    assert model.calls[0] == [1, 4, 2]  # one prefill call for all three
    assert all(len(call) <= 3 for call in model.calls[1:])
    assert len(model.calls[-1]) < 3  # the stopped sequence left the batch
    assert stats.finish_reasons[2] == "stop"


def test_seeded_sampling_in_a_batch_equals_single_runs():
    params = [SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s) for s in (1, 2)]
    prompts = [[1, 2], [5]]
    batch: dict[int, list[int]] = {0: [], 1: []}
    for step in generate_batch(SumModel(), prompts, max_tokens=12,
                               samplers=[Sampler(p) for p in params]):
        for index, token in step:
            batch[index].append(token)
    for index, (prompt, p) in enumerate(zip(prompts, params)):
        assert batch[index] == list(generate(SumModel(), prompt, max_tokens=12, sampler=Sampler(p)))
    # temperature 1 over logits 10 and 9: both peaks get drawn at some point
    assert any(t != g for t, g in zip(batch[0], expected_greedy(prompts[0], 12)))


# --- through moeswap.load and the real engine, on a tiny Mixtral-layout GGUF -----------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from gguf_builders import mixtral

    return mixtral().write(tmp_path_factory.mktemp("tiny") / "mixtral.gguf")


@pytest.fixture(scope="module")
def tiny_runtime(tiny_gguf):
    import moeswap

    return moeswap.load(tiny_gguf, tokenizer_cache_dir=tiny_gguf.parent / "cache")


def test_runtime_greedy_tokens_are_the_teacher_forced_argmax(tiny_runtime):
    prompt = tiny_runtime.encode("abcab")
    assert prompt[0] == tiny_runtime.tokenizer.bos_id
    tokens = list(tiny_runtime.generate(prompt, 8, temperature=0.0, stop_ids=frozenset()))
    logits = tiny_runtime.forward_logits(prompt + tokens)  # [T, V]
    assert logits.dtype == torch.float32 and logits.shape == (len(prompt) + 8, 32)
    steps = logits[len(prompt) - 1: -1]
    top2 = torch.topk(steps, 2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # no near-ties: equality below is meaningful
    assert steps.argmax(-1).tolist() == tokens


def test_runtime_batch_equals_single_runs(tiny_runtime):
    prompts = [tiny_runtime.encode(text) for text in ("a", "bcdefg", "ccc")]
    model = tiny_runtime.model
    batch: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step in generate_batch(model, prompts, max_tokens=5):
        for index, token in step:
            batch[index].append(token)
    for index, prompt in enumerate(prompts):
        assert batch[index] == list(generate(model, prompt, max_tokens=5)), index


def test_runtime_rejects_unknown_sampling_options_and_falls_back_to_a_plain_template(tiny_runtime):
    with pytest.raises(MoeswapError, match="unknown sampling option"):
        tiny_runtime.generate("a", 2, temprature=0.5)
    assert tiny_runtime.chat_template_fallback  # the model ships no template
    ids = tiny_runtime.chat_prompt_ids([{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "hi"}])
    assert ids == tiny_runtime.encode("system: be brief\nuser: hi\nassistant:")


def test_load_of_a_missing_file_names_it(tmp_path):
    import moeswap

    with pytest.raises(MoeswapError, match="nothing.gguf: no such file"):
        moeswap.load(tmp_path / "nothing.gguf")


def test_run_command_streams_and_reports(tiny_gguf, tiny_runtime, capsys):
    from moeswap.cli import main

    expected = list(tiny_runtime.generate("abc", 4, temperature=0.0))
    assert main(["run", str(tiny_gguf), "-p", "abc", "-n", "4", "--temp", "0", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert out == "abc" + tiny_runtime.tokenizer.decode(expected) + "\n"
    # --verbose: one line per tensor with name, shape, type and where it lives
    assert re.search(r"^blk\.1\.ffn_down_exps\.weight  \d+x\d+x\d+  F32  \S", err, re.M), err
    assert "prompt: 4 tokens" in err and f"decode: {len(expected)} tokens" in err
    assert "peak RSS" in err
