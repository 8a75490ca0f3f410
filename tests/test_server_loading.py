"""`moeswap serve` answers while its model loads (issue 24, item 3): /health 503
``{"status": "loading"}`` and every other route 503 with OpenAI's error body until the load
ends, then 200 — seen by the official `openai` client and httpx on 127.0.0.1, the load held
back by a hook the test releases. Then the command itself: the port bound and answering at
once, the plan for its KV caches and steps, the start summary, and the polling kept out of
the INFO log."""

from __future__ import annotations

import logging
import re
import threading

import httpx
import pytest

import moeswap
from moeswap.errors import MoeswapError
from moeswap.memory import HostCharge, format_size
from moeswap.server.access_log import PollingAtDebug
from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions
from moeswap.server.loading import LoadingGate
from test_server import one_thread, wait_until  # noqa: F401 (fixture)
from test_server_live import serve_app
from test_server_process import serve_process

BUILT_IN = moeswap.DEFAULT_MODEL.stem


@pytest.fixture(scope="module")
def runtime():
    return moeswap.load(moeswap.DEFAULT_MODEL, threads=1)


def test_health_is_503_loading_until_the_load_ends_then_the_openai_client_is_served(runtime):
    openai = pytest.importorskip("openai", reason="the official client is what is being checked")
    release, started = threading.Event(), threading.Event()

    def load():  # the hook: the load ends when the test says so
        started.set()
        assert release.wait(60)
        return create_app(runtime, ServerOptions(BUILT_IN, BatchOptions(ctx=64)))

    with serve_app(LoadingGate(load)) as url:
        assert started.wait(10)
        health = httpx.get(url + "/health", timeout=10)
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=BUILT_IN, prompt="import os", max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "model_loading"  # OpenAI's error object
        assert "loading" in refused.value.body["message"]
        with pytest.raises(openai.InternalServerError):
            client.models.list()
        page = httpx.get(url + "/v1/moeswap/experts", timeout=10)
        assert page.status_code == 503 and page.json()["error"]["type"] == "server_error"
        for path, media in (("/", "text/html"), ("/page.js", "text/javascript")):
            r = httpx.get(url + path, timeout=10)  # the page, which then says it is loading
            assert r.status_code == 200 and r.headers["content-type"].startswith(media)
        assert "The model is loading" in httpx.get(url + "/page.js", timeout=10).text
        release.set()
        assert wait_until(lambda: httpx.get(url + "/health", timeout=10).status_code == 200, 30)
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        assert [m.id for m in client.models.list()] == [BUILT_IN]
        completion = client.completions.create(model=BUILT_IN, prompt="import os", max_tokens=4,
                                               temperature=0)
        assert completion.usage.completion_tokens == 4


def test_a_load_that_fails_ends_the_server_and_keeps_its_error(runtime):
    failed = threading.Event()

    def load():
        raise MoeswapError("model.gguf: broken")

    gate = LoadingGate(load, on_failure=failed.set)
    with serve_app(gate) as url:
        assert failed.wait(10)
        assert httpx.get(url + "/health", timeout=10).status_code == 503
    assert isinstance(gate.error, MoeswapError) and str(gate.error) == "model.gguf: broken"


def access_record(path: str) -> logging.LogRecord:
    """A record as uvicorn's access logger makes it."""
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                             '%s - "%s %s HTTP/%s" %d', ("127.0.0.1:5", "GET", path, "1.1", 200),
                             None)


def test_polling_is_logged_at_debug_and_other_requests_at_info():
    logger = logging.getLogger("uvicorn.access")
    level = logger.level
    try:
        logger.setLevel(logging.INFO)
        for path in ("/health", "/metrics", "/v1/moeswap/experts", "/v1/moeswap/experts?x=1"):
            record = access_record(path)
            assert not PollingAtDebug().filter(record) and record.levelno == logging.DEBUG
        record = access_record("/v1/models")
        assert PollingAtDebug().filter(record) and record.levelno == logging.INFO
        logger.setLevel(logging.DEBUG)  # --log-level debug: shown, as DEBUG
        record = access_record("/health")
        assert PollingAtDebug().filter(record) and record.levelname == "DEBUG"
    finally:
        logger.setLevel(level)


def test_the_command_plans_for_its_batch_and_summarizes_the_budget_and_the_page(tmp_path):
    """`moeswap serve` on the built-in model, a budget given and planned around (--plan auto
    takes it as given): the plan and the store charge 4 contexts of 256 positions of f16 KV."""
    openai = pytest.importorskip("openai", reason="the official client is what is being checked")
    model = tmp_path / moeswap.DEFAULT_MODEL.name  # the server's log is written beside it
    model.symlink_to(moeswap.DEFAULT_MODEL)
    with serve_process(model, "--ctx", "256", "--max-batch", "4", "--plan",
                       "auto", "--host-mem", "40MiB", "--kv-type", "f16") as (url, server):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        completion = client.completions.create(model=BUILT_IN, prompt="import os", max_tokens=4,
                                               temperature=0)
        assert completion.usage.completion_tokens == 4
        for _ in range(3):  # what the page and a health check poll
            assert httpx.get(url + "/v1/moeswap/experts", timeout=10).status_code == 200
            assert httpx.get(url + "/health", timeout=10).status_code == 200
        server.log.seek(0)
        log = server.log.read()
    runtime = moeswap.load(moeswap.DEFAULT_MODEL, threads=1)
    kv = HostCharge.for_batch(256, 4, 512, "f16").kv_bytes(runtime.config)
    assert "256 positions x 4 sequences" in log
    memory = re.search(r"^moeswap serve: memory: --host-mem 40MiB: shared weights \S+, KV cache "
                       r"(\S+), working memory \S+, experts and staging \S+$", log, re.M)
    assert memory, log
    assert memory.group(1) == format_size(kv)
    assert re.search(r"^moeswap serve: experts: 96 in all; slots per tier: host \d+ \(\S+\); "
                     r"at least \d+ read from the file when used$", log, re.M), log
    assert re.search(rf"^moeswap serve: page at {re.escape(url)}/$", log, re.M), log
    assert '"POST /v1/completions HTTP/1.1" 200' in log  # INFO: the request a user sent
    assert not re.search(r'"GET /(health|v1/moeswap/experts) HTTP', log)  # the polling: DEBUG


def test_the_plan_charges_every_batch_slots_cache():
    """auto_plan for serve's --max-batch contexts: the KV line is that many times one's."""
    from moeswap.planner.auto import Machine, auto_plan
    from moeswap.planner.rates import plan_rates

    machine = Machine(total_ram=8 << 30, free_ram=4 << 30)
    one, eight = (auto_plan(moeswap.DEFAULT_MODEL, 512, machine, plan_rates({}), kv_type="f16",
                            sequences=n).plan for n in (1, 8))
    assert eight.kv_bytes == 8 * one.kv_bytes > 0
    assert eight.budget.batch == 8 and eight.host_charged > one.host_charged


def test_chat_on_a_dense_model_plans_and_summarizes_weights_kv_and_working_memory(tmp_path,
                                                                                   monkeypatch,
                                                                                   capsys):
    import io

    import tiny_models
    from moeswap.cli import main
    from moeswap.gguf_tools.convert import convert

    tiny_models.save("gemma3", tmp_path / "hf")
    dense = convert(tmp_path / "hf", tmp_path / "dense.q8_0.gguf", "q8_0")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", str(dense), "-c", "64", "-t", "1"]) == 0
    err = capsys.readouterr().err
    assert "plan auto: a dense model: every weight stays in RAM" in err
    runtime = moeswap.load(dense, threads=1)
    charge = HostCharge.for_sequence(64, 64, "f16")
    weights = sum(t.n_bytes for t in runtime.model.source.tensors)
    assert (f"moeswap chat: memory: a dense model, every weight in RAM (no expert store): shared "
            f"weights {format_size(weights)}, KV cache {format_size(charge.kv_bytes(runtime.config))}"
            f" (f16), working memory {format_size(charge.working_bytes(runtime.config))}\n") in err


def test_chat_without_a_model_chats_with_the_built_in_one(monkeypatch, capsys):
    import io

    from moeswap.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("import os\n"))
    assert main(["chat", "-c", "128", "-t", "1", "-n", "4", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert f"loaded {moeswap.DEFAULT_MODEL}: " in err
    assert "moeswap chat: experts: all 96 in RAM (copied from the file)" in err  # fits in RAM
