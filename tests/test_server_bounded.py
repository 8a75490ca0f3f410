"""Bounded work per request (issue 22), against uvicorn on 127.0.0.1: a prompt that cannot fit
is refused before it is tokenized, and with keep-recent a prompt far longer than the context
is tokenized only at its start and end, giving the reply the whole prompt gives."""

from __future__ import annotations

import httpx
import pytest
from test_server import MODEL, TEMPLATE, load, one_thread, solo_text, write_model  # noqa: F401
from test_server_live import live_server

from moeswap.context_window import common_prefix_length, fit_context

CTX = 64


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return load(write_model(tmp_path_factory.mktemp("bounded"), TEMPLATE))


class CountingTokenizer:
    """The runtime's tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.chars = 0

    def encode(self, text, **options):
        self.chars += len(text)
        return self._tokenizer.encode(text, **options)

    def encode_rendered(self, text, *, add_special=True, drop=None):
        self.chars += len(text) - (drop[1] - drop[0] if drop else 0)
        return self._tokenizer.encode_rendered(text, add_special=add_special, drop=drop)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture
def counting(runtime):
    counter = CountingTokenizer(runtime.tokenizer)
    runtime.tokenizer = counter
    yield counter
    runtime.tokenizer = counter._tokenizer


def serve(runtime, **options):
    return live_server(runtime, **options)  # --ctx 64


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(runtime, counting):
    long_text = "abcd " * 2000
    with serve(runtime) as (url, _):
        for path, body in (("/v1/completions", {"prompt": long_text}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": long_text}]}),
                           ("/v1/completions", {"prompt": list(range(4, 4 + CTX))})):
            r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert "at least" in r.json()["error"]["message"]
        assert counting.chars == 0
        # one that might fit is tokenized, and refused by its real length
        just_over = "abcd " * 20
        assert runtime.tokenizer.max_token_bytes * CTX > len(just_over) > CTX
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": just_over})
        assert r.status_code == 400 and "tokens but the context holds" in r.text
        assert counting.chars == len(just_over)


def test_keep_recent_tokenizes_only_the_ends_of_a_long_prompt(runtime, counting):
    text = "".join(f"{'abcdefg'[i % 7]}{'bcd' * (i % 3)} " for i in range(20000))
    whole = fit_context(runtime.encode(text), CTX, max_tokens=4, policy="keep-recent",
                        keep_prefix=1)
    counting.chars = 0
    with serve(runtime, ctx_policy="keep-recent") as (url, _):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": text,
                                                        "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert 0 < counting.chars < len(text) / 20
    assert r.json()["usage"]["prompt_tokens"] == len(whole)
    assert r.json()["choices"][0]["text"] == solo_text(runtime, whole, 4)[0]


def test_keep_recent_chat_keeps_the_system_prompt_of_a_long_conversation(runtime, counting):
    messages = [{"role": "system", "content": "bcd"}] + [
        {"role": ("user", "assistant")[i % 2], "content": "abcdefg"[i % 7] * (1 + i % 5)}
        for i in range(3001)]
    ids = runtime.chat_prompt_ids(messages)
    keep = common_prefix_length(runtime.chat_prompt_ids(messages[:1], add_generation_prompt=False), ids)
    whole = fit_context(ids, CTX, max_tokens=4, policy="keep-recent", keep_prefix=keep)
    counting.chars = 0
    with serve(runtime, ctx_policy="keep-recent") as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert 0 < counting.chars < len(runtime.chat_template.render(messages)) / 5
    assert r.json()["usage"]["prompt_tokens"] == len(whole)
    assert r.json()["choices"][0]["message"]["content"] == solo_text(runtime, whole, 4)[0]
