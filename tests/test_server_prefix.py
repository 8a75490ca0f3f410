"""Prefix reuse (moeswap/server/slots.py) through the official `openai` client against uvicorn
on 127.0.0.1: cached_tokens, only the new tokens fed, and replies (and their logits) equal to a
fresh server's; a sliding-window model reuses a cache only when it holds exactly the prefix."""

from __future__ import annotations

import httpx
import pytest
import torch
from gguf import GGUFValueType as T

from moeswap.server.slots import common_prefix
from test_server import MODEL, TEMPLATE, load, one_thread, write_model  # noqa: F401 (fixture)
from test_server_live import live_server

openai = pytest.importorskip("openai", reason="the official client is what is being checked")


class RecordingModel:
    """The model, recording per forward call each sequence's fed ids and its last logits row."""

    def __init__(self, model):
        self.model = model
        self.calls: list[list[tuple[list[int], torch.Tensor]]] = []

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, tokens, caches, last_only=False):
        logits = self.model.forward(tokens, caches, last_only)
        self.calls.append([(t.tolist(), rows[-1].clone()) for t, rows in zip(tokens, logits)])
        return logits


class RecordingRuntime:
    def __init__(self, runtime):
        self._runtime = runtime
        self.model = RecordingModel(runtime.model)

    def __getattr__(self, name):
        return getattr(self._runtime, name)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return load(write_model(tmp_path_factory.mktemp("prefix"), TEMPLATE))


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """The tiny Gemma 4 layout: layer 0 has a sliding window of 8 positions."""
    from gguf_builders import gemma4

    spec = gemma4()
    spec.kv["tokenizer.chat_template"] = (TEMPLATE, T.STRING)
    return load(spec.write(tmp_path_factory.mktemp("sliding") / f"{MODEL}.gguf"))


def chat(client, messages, stream: bool):
    """(reply text, usage) of a greedy chat call, whole or streamed with include_usage."""
    kwargs = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.usage
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


def complete(client, prompt_ids, stream: bool):
    kwargs = dict(model=MODEL, prompt=prompt_ids, max_tokens=3, temperature=0)
    if not stream:
        r = client.completions.create(**kwargs)
        return r.choices[0].text, r.usage
    chunks = list(client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage


def fresh(runtime, ask, *args):
    """(reply, usage, recorded calls) of one call to a server that has served nothing."""
    recording = RecordingRuntime(runtime)
    with live_server(recording) as (url, _):
        reply, usage = ask(openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), *args)
    return reply, usage, recording.model.calls


def same_logits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal but for rounding: torch's matmuls round a 1-token feed differently from a longer
    one (1 ulp, 5e-10 here), so a prefix fed over several calls is not the bits of one call.
    test_a_cut_back_cache_is_bit_for_bit_a_fresh_one checks the cut itself exactly."""
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(a, b))


def rows(calls):
    return [row for call in calls for _, row in call]


def fed(calls) -> list[int]:
    return [t for call in calls for ids, _ in call for t in ids]


def test_a_cut_back_cache_is_bit_for_bit_a_fresh_one(runtime):
    """A cache that held a longer sequence, cut back to 8 positions, then fed the rest: the
    same logits, bit for bit, as a fresh cache fed the same 8 then the same rest."""
    model, ids = runtime.model, runtime.encode("abcabcabcdab")
    other = ids[:8] + runtime.encode("dddd")[1:]
    reused = model.new_cache()
    model.forward([torch.tensor(other[:8])], [reused])
    model.forward([torch.tensor(other[8:])], [reused])
    reused.truncate(8)
    new = model.new_cache()
    model.forward([torch.tensor(ids[:8])], [new])
    a = model.forward([torch.tensor(ids[8:])], [reused])[0]
    b = model.forward([torch.tensor(ids[8:])], [new])[0]
    assert reused.length == new.length == len(ids) and torch.equal(a, b)


def test_a_three_turn_chat_reuses_its_prefix_and_replies_as_a_fresh_server(runtime):
    recording = RecordingRuntime(runtime)
    calls = recording.model.calls
    messages = [{"role": "user", "content": "bcd"}]
    turns = []  # per turn: prompt ids, reply, usage, the calls it made
    with live_server(recording) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for turn, content in enumerate(("bcd", "ca", "dab")):
            if turn:
                messages += [{"role": "assistant", "content": turns[-1][1]},
                             {"role": "user", "content": content}]
            start = len(calls)
            reply, usage = chat(client, messages, stream=turn == 2)
            turns.append((runtime.chat_prompt_ids(messages), reply, usage, calls[start:]))
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer x"}).text
    reported = sum(t[2].prompt_tokens_details.cached_tokens for t in turns)
    assert f"moeswap_cached_tokens_total {reported}" in metrics.splitlines()
    assert app.state.scheduler.counters.cached_tokens == reported
    in_cache: list[int] = []  # what the one used slot holds after each turn
    for turn, (prompt, reply, usage, made) in enumerate(turns):
        reused = min(common_prefix(in_cache, prompt), len(prompt) - 1)
        assert usage.prompt_tokens_details.cached_tokens == reused
        assert usage.prompt_tokens == len(prompt)
        if turn:  # the previous prompt and reply are reused; only the new tokens are fed
            assert reused >= len(turns[turn - 1][0]) + 1
            assert made[0][0][0] == prompt[reused:]
        in_cache = prompt[:reused] + fed(made)
        alone, alone_usage, alone_calls = fresh(runtime, chat, messages[:2 * turn + 1], turn == 2)
        assert reply == alone and alone_usage.prompt_tokens_details.cached_tokens == 0
        assert same_logits(rows(made), rows(alone_calls))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_completions_cut_a_longer_cache_back_to_the_common_prefix(runtime, stream):
    first, second = runtime.encode("abcabcab"), runtime.encode("abcdd")
    shared = common_prefix(first, second)
    assert 0 < shared < len(first)
    recording = RecordingRuntime(runtime)
    with live_server(recording) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        complete(client, first, stream)
        start = len(recording.model.calls)
        reply, usage = complete(client, second, stream)
        made = recording.model.calls[start:]
    assert usage.prompt_tokens_details.cached_tokens == shared
    assert made[0][0][0] == second[shared:]
    alone, _, alone_calls = fresh(runtime, complete, second, stream)
    assert reply == alone and same_logits(rows(made), rows(alone_calls))


def test_a_sliding_window_cache_is_reused_only_when_it_holds_exactly_the_prefix(sliding):
    """docs/SERVER.md's rule: a ring cannot be cut back, so a shorter common prefix means a
    fresh prefill; a prompt that continues the whole cache reuses all of it."""
    recording = RecordingRuntime(sliding)
    calls = recording.model.calls
    first = sliding.encode("abcdefghijkl")  # longer than the window of 8
    with live_server(recording) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        complete(client, first, stream=False)
        held = fed(calls)  # the prompt and the reply's fed tokens: all the slot's cache holds
        longer = held + sliding.encode("bc")[1:]  # the whole cache, continued
        start = len(calls)
        continued, usage = complete(client, longer, stream=False)
        continued_calls = calls[start:]
        assert usage.prompt_tokens_details.cached_tokens == len(held)
        assert continued_calls[0][0][0] == longer[len(held):]
        shorter = first[:6] + sliding.encode("zz")[1:]  # shares 6 of the cache's positions
        start = len(calls)
        cut, usage = complete(client, shorter, stream=True)
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert calls[start][0][0] == shorter  # prefilled from scratch
    alone, _, alone_calls = fresh(sliding, complete, longer, False)
    assert continued == alone and same_logits(rows(continued_calls), rows(alone_calls))
    assert cut == fresh(sliding, complete, shorter, True)[0]
