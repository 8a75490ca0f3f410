"""What a web page or a stranger can do to a local server (issue 22), against uvicorn on
127.0.0.1: the Host allow-list (DNS rebinding), JSON-only POST bodies (no CORS-free form
posts), the body size limit, and an empty API key refused."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_server import MODEL, TEMPLATE, load, one_thread, write_model  # noqa: F401 (fixture)
from test_server_live import live_server

from moeswap.errors import MoeswapError
from moeswap.server.app import ServerOptions


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return load(write_model(tmp_path_factory.mktemp("exposure"), TEMPLATE))


COMPLETION = {"model": MODEL, "prompt": "ab", "max_tokens": 2, "temperature": 0}


def test_host_header_must_be_a_local_name_the_bound_host_or_an_allowed_one(runtime):
    with live_server(runtime, bind_host="box.lan", allow_hosts=("api.example.com",)) as (url, _):
        port = url.rpartition(":")[2]

        def status(host: str, path: str = "/v1/models") -> int:
            return httpx.get(url + path, headers={"Host": host}).status_code

        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", "app.localhost",
                     f"[::1]:{port}", "10.1.2.3", "box.lan", f"api.example.com:{port}"):
            assert status(host) == 200, host
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                     "localhost.evil.example", "example.com"):
            r = httpx.get(url + "/v1/models", headers={"Host": host})
            assert r.status_code == 403, host
            assert r.json()["error"]["code"] == "host_not_allowed"
            assert "--allow-host" in r.json()["error"]["message"]
        # the page and /health too: a rebound page gets nothing from this server
        assert status("evil.example", "/") == status("evil.example", "/health") == 403
        r = httpx.post(url + "/v1/completions", json=COMPLETION, headers={"Host": "evil.example"})
        assert r.status_code == 403


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_a_post_body_that_is_not_json_gets_415(runtime, content_type):
    """Only these types reach a server from another site's page without a CORS preflight."""
    import json

    body = json.dumps(COMPLETION).encode()
    with live_server(runtime) as (url, app):
        headers = {} if content_type is None else {"Content-Type": content_type}
        r = httpx.post(url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
        ok = httpx.post(url + "/v1/completions", content=body,
                        headers={"Content-Type": "Application/JSON; charset=utf-8"})
        assert ok.status_code == 200, ok.text
        assert app.state.scheduler.counters.requests_admitted == 1  # the refused one never ran


def test_a_body_over_max_body_gets_413_before_it_is_read(runtime):
    with live_server(runtime, max_body=4096) as (url, app):
        host, port = url.removeprefix("http://").split(":")
        # declared too large: answered at once, though the body never comes
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n{")
            reply = b""
            while b"}}" not in reply and (chunk := s.recv(65536)):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 413"), reply
        assert b'"request_too_large"' in reply and b"--max-body" in reply

        def chunks():  # no Content-Length: refused as the stream passes the limit
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(1000):
                yield b"a" * 1000
            yield b'"}'

        r = httpx.post(url + "/v1/completions", content=chunks(),
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        fits = httpx.post(url + "/v1/completions", json=COMPLETION)
        assert fits.status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        assert app.state.scheduler.counters.requests_admitted == 1


def test_an_empty_api_key_is_refused():
    for key in ("", "  "):
        with pytest.raises(MoeswapError, match="--api-key is empty"):
            ServerOptions(MODEL, api_key=key)


def test_serve_refuses_an_empty_api_key_before_loading(tmp_path):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "moeswap", "serve", str(tmp_path / "absent.gguf"),
                           "--api-key", ""], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "moeswap: error: --api-key is empty: that would turn the key check off; give a key, "
        "or leave the flag out to serve without one"]
    assert time.monotonic() - started < 60


def test_heap_is_trimmed_after_every_post_refused_ones_too(runtime, monkeypatch):
    import moeswap.server.guard as guard

    trims = []
    monkeypatch.setattr(guard, "heap_trimmer", lambda: lambda: trims.append(1))
    with live_server(runtime, api_key="k", max_body=4096) as (url, _):
        key = {"Authorization": "Bearer k"}
        statuses = [
            httpx.post(url + "/v1/completions", json=COMPLETION).status_code,  # no key
            httpx.post(url + "/v1/completions", content=b"{}", headers=key).status_code,  # type
            httpx.post(url + "/v1/completions", json={"prompt": "a" * 5000}, headers=key).status_code,
            httpx.post(url + "/v1/completions", json={"model": MODEL}, headers=key).status_code,
            httpx.post(url + "/v1/completions", json=COMPLETION, headers=key).status_code,
        ]
        httpx.get(url + "/health")  # a GET reads no body: nothing to trim
    assert statuses == [401, 415, 413, 400, 200]
    assert len(trims) == 5
