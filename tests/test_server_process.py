"""`moeswap serve` as its own process on 127.0.0.1, sent what froze or bloated it before
(issue 22): its anonymous memory (RssAnon, from /proc) and /health are watched meanwhile.
Linux only (/proc)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from test_server import MODEL, write_model
from test_server_templates import HOSTILE, chat

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
MiB = 2**20


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


@contextmanager
def serve_process(model: Path, *flags: str):
    """(base url, the process) of `moeswap serve` on a free loopback port, /health answering."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(model.parent / f"serve-{port}.log", "w+")
    env = {**os.environ, "XDG_CACHE_HOME": str(model.parent / "cache")}
    process = subprocess.Popen([sys.executable, "-m", "moeswap", "serve", str(model), "--port",
                                str(port), "--threads", "1", "--ctx", "64", *flags],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, Path(log.name).read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not answer within 120 s"
            time.sleep(0.1)
        process.log = log
        yield url, process
    finally:
        process.terminate()
        process.wait(60)
        log.close()


class HealthWatch:
    """Polls /health every 50 ms on a thread: the slowest answer, any failure, and the
    server's highest RssAnon meanwhile."""

    def __init__(self, url: str, pid: int):
        self.url, self.pid, self.slowest, self.failures = url, pid, 0.0, []
        self.peak = rss_anon(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                status = httpx.get(self.url + "/health", timeout=10).status_code
                if status != 200:
                    self.failures.append(status)
            except httpx.TransportError as e:
                self.failures.append(repr(e))
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.peak = max(self.peak, rss_anon(self.pid))
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("process"), HOSTILE)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def settle(pid: int) -> int:
    """RssAnon once the server is idle (the trim after a request runs on a thread)."""
    time.sleep(0.5)
    return rss_anon(pid)


def test_large_requests_are_refused_cheaply_and_memory_comes_back(hostile_model):
    big = "ab " * (4 * MiB // 3 - 100)  # just under --max-body once in JSON
    with serve_process(hostile_model) as (url, server):
        assert post(url, "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 2,
                                             "temperature": 0}).status_code == 200
        baseline = settle(server.pid)
        with HealthWatch(url, server.pid) as health:
            started = time.monotonic()
            r = post(url, "/v1/completions", {"model": MODEL, "prompt": big})
            completion_seconds = time.monotonic() - started
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            started = time.monotonic()
            r = post(url, "/v1/chat/completions", chat(big))
            chat_seconds = time.monotonic() - started
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            r = httpx.post(url + "/v1/completions", content=b"{" + b" " * (50 * MiB) + b"}",
                           headers={"Content-Type": "application/json"}, timeout=120)
            assert r.status_code == 413
            for attack in ("center", "repeat", "indent", "output"):  # in the renderer's process
                assert post(url, "/v1/chat/completions", chat(attack)).status_code == 400
        growth = settle(server.pid) - baseline
        print(f"\n4 MiB prompt refused in {completion_seconds:.2f} s (completion), "
              f"{chat_seconds:.2f} s (chat); slowest /health {health.slowest:.2f} s; "
              f"RssAnon {baseline / MiB:.0f} MiB, idle after {growth / MiB:+.1f} MiB")
        assert health.failures == []
        assert health.slowest < 2.0  # generous: it answered in milliseconds here
        assert growth < 32 * MiB, growth / MiB


def test_keep_recent_tokenizes_only_the_ends_of_a_large_prompt(hostile_model):
    big = "ab " * (4 * MiB // 3 - 100)
    with serve_process(hostile_model, "--ctx-policy", "keep-recent") as (url, server):
        baseline = settle(server.pid)
        seconds = []
        with HealthWatch(url, server.pid) as health:
            for path, body in (("/v1/completions", {"prompt": big}),
                               ("/v1/chat/completions", chat(big))):
                started = time.monotonic()
                r = post(url, path, {"model": MODEL, **body, "max_tokens": 2, "temperature": 0})
                seconds.append(time.monotonic() - started)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens"] < 64
        growth = settle(server.pid) - baseline
        print(f"\n4 MiB prompt cut and answered in {seconds[0]:.2f} s (completion), "
              f"{seconds[1]:.2f} s (chat); slowest /health {health.slowest:.2f} s; RssAnon "
              f"{baseline / MiB:.0f} MiB, peak {(health.peak - baseline) / MiB:+.0f} MiB, idle "
              f"after {growth / MiB:+.1f} MiB")
        assert health.failures == [] and health.slowest < 2.0
        # tokenized whole, the completion alone took 17 s and peaked at +692 MiB
        assert health.peak - baseline < 128 * MiB
        assert growth < 32 * MiB, growth / MiB


def test_sigterm_ends_the_server_while_a_template_loops(hostile_model):
    with serve_process(hostile_model) as (url, server):
        looping = threading.Thread(target=lambda: post(url, "/v1/chat/completions", chat("loops")),
                                   daemon=True)
        looping.start()
        time.sleep(1.0)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught


@pytest.mark.parametrize("template", ["{% if %}", "{{ " + "9" * 5000 + " }}"],
                         ids=["syntax error", "int over the string limit"])
def test_a_template_that_cannot_compile_is_one_line_and_chat_gets_a_json_error(tmp_path, template):
    model = write_model(tmp_path, template)
    with serve_process(model) as (url, server):
        r = post(url, "/v1/chat/completions", chat("bcd"))
        assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_unavailable"
        assert "cannot be used" in r.json()["error"]["message"]
        assert post(url, "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 2,
                                             "temperature": 0}).status_code == 200
        server.log.seek(0)
        log = server.log.read()
    warnings = [line for line in log.splitlines() if "chat template" in line]
    assert len(warnings) == 1 and warnings[0].startswith("moeswap serve: warning: the chat template")
    assert "Traceback" not in log
