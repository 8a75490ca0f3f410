"""What the web page's tier counts and memory panel read from /v1/moeswap/experts (issue 24,
item 9), over httpx against uvicorn on 127.0.0.1, the requests sent by the official `openai`
client: on the built-in model with a store, the experts each tier holds against its slots; on
a dense model, the weights, KV caches and working memory the panel shows instead of an empty
expert grid, checked against the file's sizes and moeswap.memory's charge."""

from __future__ import annotations

import httpx
import pytest

import moeswap
import tiny_models
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.gguf_tools.convert import convert
from moeswap.memory import HostCharge
from moeswap.server.activity import ExpertActivity
from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions
from test_planner import sizes_of
from test_server import one_thread  # noqa: F401 (fixture)
from test_server_live import serve_app
from test_server_page import store_sizes

BATCH = BatchOptions(max_batch=4, ctx=128, step_tokens=64)


def experts_body(url: str) -> dict:
    r = httpx.get(url + "/v1/moeswap/experts", timeout=30)
    assert r.status_code == 200
    return r.json()


def complete(url: str, model: str) -> None:
    openai = pytest.importorskip("openai", reason="the official client is what is being checked")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.completions.create(model=model, prompt="import os\n", max_tokens=8,
                                      temperature=0)
    assert reply.usage.completion_tokens == 8


def test_the_built_in_model_reports_experts_held_against_each_tiers_slots():
    path = moeswap.DEFAULT_MODEL
    fixed, slot, _ = store_sizes(path)
    factory = build_store(OffloadSettings(host_bytes=fixed + 20 * slot),
                          HostCharge.for_batch(BATCH.ctx, BATCH.max_batch, BATCH.step_tokens))
    activity = ExpertActivity()
    runtime = moeswap.load(path, threads=1, expert_runner=factory, recorder=activity)
    app = create_app(runtime, ServerOptions(path.stem, BATCH), activity)
    with serve_app(app) as url:
        before = experts_body(url)
        complete(url, path.stem)
        after = experts_body(url)
    slots = runtime.stats()["tiers"]["host"]["slots"]
    assert 0 < slots < len(before["layers"]) * before["n_experts"]  # not every expert fits
    assert before["tiers"]["host"] == {"held": 0, "slots": slots}
    held = after["tiers"]["host"]["held"]
    assert 0 < held <= slots
    assert held == sum(row.count("host") for row in after["tier"])  # the grid's own cells
    memory = after["memory"]
    sizes = sizes_of(path)
    assert memory["dense"] is False and memory["budget_bytes"] == fixed + 20 * slot
    assert (memory["shared_bytes"], memory["expert_bytes"]) == (sizes.shared_bytes,
                                                                sizes.routed_bytes)
    assert memory["kv_bytes"] == runtime.stats()["kv_bytes"]  # what the store charged


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    tiny_models.save("gemma3", folder / "hf")
    return convert(folder / "hf", folder / "dense.q8_0.gguf", "q8_0")


def test_a_dense_model_gets_weights_kv_and_budget_instead_of_an_empty_grid(dense_path):
    runtime = moeswap.load(dense_path, threads=1, kv_type="f16")
    app = create_app(runtime, ServerOptions("dense", BATCH), ExpertActivity())
    with serve_app(app) as url:
        complete(url, "dense")
        body = experts_body(url)
    assert body["layers"] == [] and body["tiers"] == {}
    sizes = sizes_of(dense_path)
    charge = HostCharge.for_batch(BATCH.ctx, BATCH.max_batch, BATCH.step_tokens, "f16")
    assert body["memory"] == {
        "dense": True, "shared_bytes": sizes.total_bytes, "expert_bytes": 0,
        "kv_bytes": charge.kv_bytes(runtime.config), "kv_type": "f16",
        "working_bytes": charge.working_bytes(runtime.config), "contexts": 4, "ctx": 128,
        "budget_bytes": None}
    assert body["memory"]["kv_bytes"] > 0
