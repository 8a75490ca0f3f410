"""What people coming from llama-server expect of names and sizes (issue 24, part): --alias,
`moeswap serve` without a model serving the built-in one, --ctx defaulting to the trained
context when shorter than 4096, and a warning when --ctx passes it."""

from __future__ import annotations

import re

import pytest

from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.server.app import ServerOptions
from test_server import MODEL, TEMPLATE, load, serve, wait_until, write_model  # noqa: F401


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return load(write_model(tmp_path_factory.mktemp("names"), TEMPLATE))


def test_an_alias_is_listed_accepted_and_echoed(runtime):
    with serve(runtime, aliases=("gpt-4o-mini",), strict_model=True) as client:
        listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert listed == [MODEL, "gpt-4o-mini"]
        for name in listed:
            r = client.post("/v1/completions", json={"model": name, "prompt": "ab",
                                                     "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == name
        r = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "ab"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "`tiny`, `gpt-4o-mini`" in r.json()["error"]["message"]
    with pytest.raises(MoeswapError, match="--alias is empty"):
        ServerOptions(MODEL, aliases=(" ",))


def test_without_strict_model_any_name_is_served(runtime):
    with serve(runtime) as client:  # llama-server's habit: one model, whatever it is called
        r = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "ab",
                                                 "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "gpt-4"


def test_serve_defaults_to_the_built_in_model_and_warns_past_the_trained_context(monkeypatch,
                                                                                 capsys):
    import uvicorn
    from fastapi.testclient import TestClient

    import moeswap

    served = {}

    def run(server, sockets):
        """uvicorn's run, in a test client: its lifespan starts the load; wait for it."""
        served.update(address=sockets[0].getsockname()[:2])
        sockets[0].close()
        with TestClient(server.config.app, base_url="http://127.0.0.1") as client:
            assert wait_until(lambda: client.get("/health").status_code == 200)
            served.update(ids=[m["id"] for m in client.get("/v1/models").json()["data"]])

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["serve", "-c", "4096", "-a", "local", "-t", "1", "--port", "0"]) == 0
    assert served["address"][0] == "127.0.0.1"
    assert "--ctx 4096 is more than the 1024 positions" in capsys.readouterr().err
    assert served["ids"] == [moeswap.DEFAULT_MODEL.stem, "local"]
    assert main(["serve", "-c", "512", "--port", "0"]) == 0  # within the trained context
    err = capsys.readouterr().err
    assert "positions this model was trained for" not in err
    # no budget given: --plan auto, for 8 contexts of 512 positions; the model fits in RAM
    assert "512 positions x 8 sequences" in err and "all resident" in err
    assert re.search(r"^moeswap serve: memory: every weight in RAM \(no --host-mem\): shared "
                     r"weights .*, KV cache .* \(f16\), working memory .*, experts .*$", err, re.M)
    assert re.search(r"^moeswap serve: page at http://127.0.0.1:[1-9]\d*/$", err, re.M)
    assert main(["serve", "-c", "256", "--host-mem", "40MiB", "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert "plan auto" not in err  # the budget given
    summary = [line for line in err.splitlines()
               if line.startswith("moeswap serve: memory: --host-mem 40MiB: shared weights")]
    assert len(summary) == 1 and "experts and staging" in summary[0]
    assert re.search(r"^moeswap serve: experts: 96 in all; slots per tier: host \d+ ", err, re.M)


def test_a_busy_port_is_reported_before_loading(monkeypatch, capsys):
    import socket

    from moeswap.cli import serve_commands

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setattr(serve_commands, "_load", lambda *a: pytest.fail("loaded the model"))
    port = str(taken.getsockname()[1])
    assert main(["serve", "--port", port]) == 2
    assert f"--port {port}: cannot listen there" in capsys.readouterr().err
    taken.close()


def test_ctx_defaults_to_the_trained_context_when_shorter(tmp_path):
    import moeswap
    from moeswap.cli.common_args import DEFAULT_CTX, default_ctx

    assert default_ctx(moeswap.DEFAULT_MODEL) == 1024  # trained on 1,024 positions
    assert default_ctx(write_model(tmp_path, TEMPLATE)) == 128  # its context_length
    assert default_ctx(tmp_path / "missing.gguf") == DEFAULT_CTX == 4096
