"""The server answers what a client gets wrong with OpenAI's error bodies and goes on: the API
key, a 4xx for each bad input, unknown routes, a template the sandbox stops, random bodies that
never get a 5xx (hypothesis), and a failing step that ends only its own request."""

# ruff: noqa: F811 (test_server's fixtures, imported, are the tests' arguments)
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st
from test_server import (INJECTION, MODEL, GatedModel, WrappedRuntime,  # noqa: F401 (fixtures)
                         load, one_thread, runtime, serve, sse_events, tiny_path, write_model)


def test_api_key_is_required_except_for_health(runtime):
    with serve(runtime, api_key="s3cret") as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        # refused before the body is even read: a bad body without a key is still a 401
        assert client.post("/v1/completions", content=b"{not json").status_code == 401
        assert client.get("/metrics").status_code == 401
        ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


BAD_INPUTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("NaN and Infinity (Python's JSON reads them)", "/v1/completions",
     b'{"model": "tiny", "prompt": "a", "temperature": Infinity, "repeat_penalty": NaN}', 400,
     "invalid_value"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model_not_found"),
    ("prompt of the wrong type", "/v1/completions", {"model": MODEL, "prompt": 5}, 400, "invalid_value"),
    ("max_tokens as a string", "/v1/completions",
     {"model": MODEL, "prompt": "a", "max_tokens": "10"}, 400, "invalid_value"),
    ("stream as a string", "/v1/completions",
     {"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "invalid_value"),
    ("negative max_tokens", "/v1/completions",
     {"model": MODEL, "prompt": "a", "max_tokens": -5}, 400, "invalid_value"),
    ("huge n", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 10**9}, 400, None),
    ("prompt over the context", "/v1/completions",
     {"model": MODEL, "prompt": "ab" * 40}, 400, "context_length_exceeded"),
    ("token id outside the vocabulary", "/v1/completions",
     {"model": MODEL, "prompt": [1, 99999]}, 400, None),
    ("messages not a list", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "invalid_value"),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "invalid_value"),
    ("unknown role", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "wizard", "content": "a"}]}, 400, "invalid_value"),
    ("echo is not built", "/v1/completions", {"model": MODEL, "prompt": "a", "echo": True},
     400, "unsupported_parameter"),
    ("too many top_logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "logprobs": True,
      "top_logprobs": 21}, 400, "invalid_value"),
    ("temperature out of range", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "temperature": 9}, 400, "invalid_value"),
    ("a body that is a list", "/v1/chat/completions", [1, 2], 400, "invalid_value"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_4xx_with_an_openai_error_body(runtime, case):
    _, path, body, status, code = case
    with serve(runtime, strict_model=True) as client:  # the unknown model's 404
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = client.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if code is not None:
            assert error["code"] == code
        assert client.get("/health").status_code == 200


def test_unknown_route_and_method_get_openai_error_bodies(runtime):
    with serve(runtime) as client:
        r = client.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = client.get("/v1/completions")
        assert r.status_code == 405 and "message" in r.json()["error"]


def test_template_injection_is_stopped_by_the_sandbox(tmp_path):
    evil = load(write_model(tmp_path, INJECTION))
    with serve(evil) as client:
        r = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 400 and "sandbox" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200


class ListCache(list):
    """The fed ids, cut back as a KVCache is when the server reuses its prefix."""

    def can_truncate(self, n_tokens: int) -> bool:
        return n_tokens <= len(self)

    def truncate(self, n_tokens: int) -> None:
        del self[n_tokens:]


class CountingModel:
    """A fast stand-in for the engine: the next token is the cache length mod the vocabulary."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def new_cache(self):
        return ListCache()

    def forward(self, tokens, caches, last_only=False):
        out = []
        for ids, cache in zip(tokens, caches):
            cache.extend(ids.tolist())
            logits = torch.zeros(len(ids), self.vocab)
            logits[:, (len(cache) + 4) % self.vocab] = 1.0  # never BOS/EOS-adjacent ids 0..3
            out.append(logits)
        return out


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) |
                    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": st.text("abcd", max_size=6)}), max_size=3)
VALID = {  # in range: such a body alone is answered 200
    "prompt": st.text("abcd", max_size=30) | st.lists(st.integers(4, 31), min_size=1, max_size=4),
    "messages": MESSAGES.filter(bool), "max_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1), "n": st.integers(1, 3), "stream": st.booleans(),
    "stop": st.text("abc", max_size=2) | st.lists(st.text("abc", max_size=2), max_size=4),
    "seed": st.integers(-2**80, 2**80), "repeat_penalty": st.floats(0.5, 2),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
JUNK = st.dictionaries(st.sampled_from(sorted(VALID) + ["model", "logprobs"]),
                       JSON | st.integers(-10, 100) | st.floats(-5, 5), max_size=2)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.fixed_dictionaries({"model": st.just(MODEL)}, optional=VALID), junk=JUNK)


def test_random_bodies_never_get_a_5xx(fast_client, path, body, junk):
    r = fast_client.post(path, json={**body, **junk})
    event(f"status {r.status_code}")
    assert r.status_code < 500, (body, junk, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


class NaNModel(CountingModel):
    def forward(self, tokens, caches, last_only=False):
        return [torch.full_like(rows, float("nan")) for rows in super().forward(tokens, caches, last_only)]


def test_a_failing_step_ends_its_request_and_the_server_goes_on(runtime):
    broken = WrappedRuntime(runtime, GatedModel)
    broken.model = NaNModel(runtime.tokenizer.vocab_size)  # sampling from NaN raises
    with serve(broken) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "temperature": 1})
        assert r.status_code == 500 and "sampling failed" in r.json()["error"]["message"]
        with client.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "ab", "temperature": 1, "stream": True}) as s:
            assert sse_events(s)[-1]["error"]["type"] == "server_error"
        assert client.get("/health").json()["status"] == "ok"
        assert client.app.state.scheduler.counters.requests_finished == {"error": 2}


@pytest.fixture(scope="module")
def fast_client(runtime):
    fake = WrappedRuntime(runtime, GatedModel)
    fake.model = CountingModel(runtime.tokenizer.vocab_size)
    with serve(fake, batch={"ctx": 16}) as client:
        yield client
