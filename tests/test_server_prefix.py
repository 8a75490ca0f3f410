"""Prefix reuse (moeswap/server/slots.py) through the official `openai` client against uvicorn
on 127.0.0.1: cached_tokens, only the new tokens fed, and replies (and their logits) equal to a
fresh server's; a sliding-window model reuses a cache only when it holds exactly the prefix."""

from __future__ import annotations

from contextlib import contextmanager

import httpx
import pytest
import torch
from gguf import GGUFValueType as T

from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions
from moeswap.context_window import common_prefix_length as common_prefix
from test_server import (MODEL, TEMPLATE, WrappedRuntime, load, one_thread,  # noqa: F401 (fixture)
                         write_model)
from test_server_live import live_server, serve_app

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


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return load(write_model(tmp_path_factory.mktemp("prefix"), TEMPLATE))


SLIDING = BatchOptions(ctx=64, step_tokens=8)  # each ring holds 7 + 8 positions


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """The tiny Gemma 4 layout: layer 0 has a sliding window of 8 positions; caches sized as
    the server's budget charges them for SLIDING."""
    from gguf_builders import gemma4

    spec = gemma4()
    spec.kv["tokenizer.chat_template"] = (TEMPLATE, T.STRING)
    return load(spec.write(tmp_path_factory.mktemp("sliding") / f"{MODEL}.gguf"),
                context_tokens=SLIDING.ctx, step_tokens=SLIDING.step_tokens)


@contextmanager
def client_of(runtime, batch: BatchOptions = BatchOptions(ctx=64)):
    """An `openai` client of the app served on a free loopback port."""
    with serve_app(create_app(runtime, ServerOptions(MODEL, batch))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

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


def fresh(runtime, ask, *args, batch: BatchOptions = BatchOptions(ctx=64)):
    """(reply, usage, recorded calls) of one call to a server that has served nothing."""
    recording = WrappedRuntime(runtime, RecordingModel)
    with client_of(recording, batch) as client:
        reply, usage = ask(client, *args)
    return reply, usage, recording.model.calls


def same_logits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal but for rounding: torch's matmuls round a 1-token feed differently from a longer
    one (1 ulp, 5e-10 here), so a prefix fed over several calls is not the bits of one call.
    test_a_cut_back_cache_is_bit_for_bit_a_fresh_one checks the cut itself exactly."""
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(a, b))


def rows(calls, prefill: int = 0) -> list[torch.Tensor]:
    """The last-position rows of the calls from the one that fed the prompt's last token on
    (those that picked reply tokens); prefill: prompt tokens the calls fed."""
    fed_so_far, out = 0, []
    for call in calls:
        for ids, row in call:
            fed_so_far += len(ids)
            if fed_so_far >= prefill:
                out.append(row)
    return out


def fed(calls) -> list[int]:
    return [t for call in calls for ids, _ in call for t in ids]


@pytest.mark.parametrize("family", ["runtime", "sliding"])
def test_a_cut_back_cache_is_bit_for_bit_a_fresh_one(family, request):
    """A cache that held a longer sequence, cut back to 8 positions, then fed the rest: the
    same logits, bit for bit, as a fresh cache fed the same 8 then the same rest (on the
    sliding-window model, a ring that still holds the window before position 8)."""
    loaded = request.getfixturevalue(family)
    model, ids = loaded.model, loaded.encode("abcabcabcdab")
    other = ids[:8] + loaded.encode("dddd")[1:]
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
    recording = WrappedRuntime(runtime, RecordingModel)
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
        assert same_logits(rows(made, len(prompt) - reused), rows(alone_calls, len(prompt)))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_completions_cut_a_longer_cache_back_to_the_common_prefix(runtime, stream):
    first, second = runtime.encode("abcabcab"), runtime.encode("abcdd")
    shared = common_prefix(first, second)
    assert 0 < shared < len(first)
    recording = WrappedRuntime(runtime, RecordingModel)
    with live_server(recording) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        complete(client, first, stream)
        start = len(recording.model.calls)
        reply, usage = complete(client, second, stream)
        made = recording.model.calls[start:]
    assert usage.prompt_tokens_details.cached_tokens == shared
    assert made[0][0][0] == second[shared:]
    alone, _, alone_calls = fresh(runtime, complete, second, stream)
    assert reply == alone
    assert same_logits(rows(made, len(second) - shared), rows(alone_calls, len(second)))


def test_a_sliding_window_cache_is_cut_back_only_while_its_ring_holds_the_window(sliding):
    """docs/SERVER.md's rule: a ring keeps its last window - 1 + --step-tokens positions, so a
    prefix a few positions shorter than the cache is reused; one the ring no longer holds the
    window before is prefilled from scratch."""
    recording = WrappedRuntime(sliding, RecordingModel)
    calls = recording.model.calls
    first = sliding.encode("abcdefghijklmnopqrs")  # 20 ids: longer than the ring's 15
    with client_of(recording, SLIDING) as client:
        complete(client, first, stream=False)
        held = fed(calls)  # the prompt and the reply's fed tokens: all the slot's cache holds
        cut = len(held) - 4  # the ring holds from len(held) - 15; this needs from cut - 7
        near = held[:cut] + [t for t in sliding.encode("zz")[1:] if t != held[cut]]
        start = len(calls)
        near_reply, usage = complete(client, near, stream=False)
        near_calls = calls[start:]
        assert usage.prompt_tokens_details.cached_tokens == cut
        assert near_calls[0][0][0] == near[cut:]
        far = first[:6] + sliding.encode("zz")[1:]  # needs positions 0..5: long overwritten
        start = len(calls)
        far_reply, usage = complete(client, far, stream=True)
        far_calls = calls[start:]
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert fed(far_calls[:1]) == far[:SLIDING.step_tokens]  # prefilled from scratch
    for prompt, reused, reply, made, stream in ((near, cut, near_reply, near_calls, False),
                                                (far, 0, far_reply, far_calls, True)):
        alone, _, alone_calls = fresh(sliding, complete, prompt, stream, batch=SLIDING)
        assert reply == alone
        assert same_logits(rows(made, len(prompt) - reused), rows(alone_calls, len(prompt)))
