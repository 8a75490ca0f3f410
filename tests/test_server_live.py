"""The server under uvicorn on 127.0.0.1 (a real socket): the official `openai` client against
it, and clients that hang up mid-reply, which must cancel their requests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions
from test_server import (MODEL, TEMPLATE, GatedModel, WrappedRuntime, load,  # noqa: F401 (fixture)
                         one_thread, solo_text, wait_until, write_model)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("live"), TEMPLATE)
    return load(path)


@contextmanager
def serve_app(app):
    """The app served by uvicorn on a free loopback port -> its base url (no trailing slash)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started, "uvicorn did not start within 10 s"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def live_server(runtime, **options):
    """(base url, app) of the app served by uvicorn on a free loopback port."""
    app = create_app(runtime, ServerOptions(MODEL, BatchOptions(ctx=64), **options))
    with serve_app(app) as url:
        yield url, app


def test_openai_client_lists_completes_chats_and_streams(runtime):
    openai = pytest.importorskip("openai", reason="the official client is what is being checked")
    messages = [{"role": "user", "content": "bcd"}]
    chat_ids = runtime.chat_prompt_ids(messages)
    with live_server(runtime, api_key="k3y", strict_model=True) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL]
        completion = client.completions.create(model=MODEL, prompt="abcab", max_tokens=6,
                                               temperature=0)
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                              temperature=0)
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="a")
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="a", max_tokens=-1)
    # greedy output equals `moeswap run`'s (Runtime.generate) for the same prompt
    assert completion.choices[0].text == solo_text(runtime, runtime.encode("abcab"), 6)[0]
    assert chat.choices[0].message.content == streamed == solo_text(runtime, chat_ids, 6)[0]


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "whole"])
def test_a_client_that_hangs_up_cancels_its_request(runtime, stream):
    slow = WrappedRuntime(runtime, GatedModel)
    slow.model.gate.set()
    forward = slow.model.forward

    def slow_forward(tokens, caches, last_only=False):
        time.sleep(0.03)  # 60 tokens take ~2 s: far longer than the client stays
        return forward(tokens, caches, last_only)

    slow.model.forward = slow_forward
    with live_server(slow) as (url, app):
        request = {"model": MODEL, "prompt": "ab", "max_tokens": 60, "temperature": 0,
                   "stream": stream}
        try:
            # The whole reply takes >= 1.8 s, so a 0.3 s read timeout always hangs up first;
            # connecting and sending get 5 s, so a busy machine does not fail the test.
            with httpx.stream("POST", url + "/v1/completions", json=request,
                              timeout=httpx.Timeout(5, read=5 if stream else 0.3)) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
        except httpx.ReadTimeout:
            assert not stream  # the whole reply was not waited for
        counters = app.state.scheduler.counters
        assert wait_until(lambda: counters.requests_finished)
        assert counters.requests_finished == {"cancelled": 1}
        assert counters.generated_tokens < 60
        assert app.state.scheduler.active_count == 0
