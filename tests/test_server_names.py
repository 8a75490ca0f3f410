"""What people coming from llama-server expect of names and sizes (issue 24, part): --alias,
`moeswap serve` without a model serving the built-in one, and a warning when --ctx passes the
positions the model was trained for."""

from __future__ import annotations

import pytest

from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.server.app import ServerOptions
from test_server import MODEL, TEMPLATE, load, serve, write_model  # noqa: F401


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

    import moeswap

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    assert main(["serve", "-c", "4096", "-a", "local", "-t", "1"]) == 0
    assert served["host"] == "127.0.0.1"
    assert "--ctx 4096 is more than the 1024 positions" in capsys.readouterr().err
    from fastapi.testclient import TestClient

    with TestClient(served["app"], base_url="http://127.0.0.1") as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == [moeswap.DEFAULT_MODEL.stem, "local"]
    assert main(["serve", "-c", "512"]) == 0  # within the trained context: no warning
    assert "warning" not in capsys.readouterr().err
