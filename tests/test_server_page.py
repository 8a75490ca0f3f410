"""The web page's data: /v1/moeswap/experts against an independent record of the same run
(the routing recorder of a model without a store), and the page's files served offline and
without the API key while the data needs it. The page in a real browser: tests/test_web_page.py."""

from __future__ import annotations

import re
from importlib import resources

import pytest
from fastapi.testclient import TestClient

from moeswap.memory import HostCharge
from moeswap.experts.store import shared_bytes
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.tiers import slot_bytes
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models.quant_experts import ExpertLayout
from moeswap.routing.recorder import RoutingRecorder
from moeswap.server.activity import ExpertActivity
from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions
from test_server import LOCAL, MODEL, TEMPLATE, load, one_thread, wait_until, write_model  # noqa: F401

CTX, PROMPT, N_TOKENS = 32, "abcab", 4
CHARGE = HostCharge.for_sequence(CTX * 8)  # the KV cache of 8 batch slots


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("page"), TEMPLATE)


def experts_after_one_completion(runtime, activity, **options):
    """The experts body once a greedy completion of PROMPT has ended and been counted."""
    app = create_app(runtime, ServerOptions(MODEL, BatchOptions(ctx=CTX), **options), activity)
    headers = {"Authorization": "Bearer k"} if options.get("api_key") else {}
    with TestClient(app, base_url=LOCAL) as client:
        r = client.post("/v1/completions", headers=headers, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == N_TOKENS
        counters = app.state.scheduler.counters
        assert wait_until(lambda: counters.generated_tokens == N_TOKENS)  # counted after the event
        return client.get("/v1/moeswap/experts", headers=headers).json()


def reference_steps(tiny_path, n_layers: int) -> list[list[set[int]]]:
    """Per forward step, per MoE layer: the experts the same greedy run picked, recorded by the
    routing recorder on the model without a store (the store's logits are bit-identical)."""
    recorder = RoutingRecorder()
    runtime = load(tiny_path, recorder=recorder)
    prompt = runtime.encode(PROMPT)
    assert len(list(runtime.generate(prompt, N_TOKENS, temperature=0.0))) == N_TOKENS
    config = runtime.config
    trace = recorder.trace(model=MODEL, arch="llama", layers=config.moe_layers,
                           n_experts=config.n_expert, k=config.n_expert_used)
    ids = trace.expert_ids  # [T, L, K]: the prompt, then one token per decode step
    steps = [ids[:len(prompt)]] + [ids[t:t + 1] for t in range(len(prompt), ids.shape[0])]
    assert len(steps) == N_TOKENS and ids.shape[1] == n_layers
    return [[set(step[:, layer].reshape(-1).tolist()) for layer in range(n_layers)]
            for step in steps]


def store_sizes(tiny_path):
    gguf = GGUFFile.open(tiny_path)
    config = config_from_gguf(gguf)
    layouts = [ExpertLayout.from_file(gguf, i) for i in config.moe_layers]
    slot = slot_bytes(layouts)
    fixed = CHARGE.bytes(config, shared_bytes(gguf, config.moe_layers),
                         config.n_expert_used * slot)
    return fixed, slot, layouts[0].expert_bytes


def test_experts_report_every_experts_tier_last_use_and_the_store_counters(tiny_path):
    fixed, slot, expert_bytes = store_sizes(tiny_path)
    activity = ExpertActivity()
    factory = build_store(OffloadSettings(host_bytes=fixed + 8 * slot), CHARGE)  # all 8 fit
    view = experts_after_one_completion(load(tiny_path, expert_runner=factory, recorder=activity),
                                        activity)
    steps = reference_steps(tiny_path, 2)
    last_use = [[None] * 4 for _ in range(2)]
    for step, layers in enumerate(steps, start=1):
        for layer, experts in enumerate(layers):
            for e in experts:
                last_use[layer][e] = step
    used = {(layer, e) for layers in steps for layer, experts in enumerate(layers) for e in experts}
    requests = sum(len(experts) for layers in steps for experts in layers)
    assert view["model"] == MODEL and view["chat"] is True
    assert view["layers"] == [0, 1] and view["n_experts"] == 4
    assert view["step"] == N_TOKENS  # one forward call per token: the prompt, then 3 decodes
    assert view["last_use"] == last_use
    # every expert used is read once into the host tier and stays: the budget holds all 8
    assert view["tier"] == [["host" if (layer, e) in used else "disk" for e in range(4)]
                            for layer in range(2)]
    c = view["counters"]
    assert (c["prompt_tokens"], c["generated_tokens"]) == (len(load(tiny_path).encode(PROMPT)), 4)
    assert (c["queue_depth"], c["batch_size"]) == (0, 0)
    assert c["expert_requests"] == requests
    assert c["disk_bytes"] == len(used) * expert_bytes and c["transfer_bytes"] == 0
    assert c["hit_rate"] == pytest.approx((requests - len(used)) / requests)


def test_a_small_host_tier_holds_the_three_experts_lru_kept(tiny_path):
    fixed, slot, _ = store_sizes(tiny_path)
    activity = ExpertActivity()
    factory = build_store(OffloadSettings(host_bytes=fixed + 3 * slot), CHARGE)
    view = experts_after_one_completion(load(tiny_path, expert_runner=factory, recorder=activity),
                                        activity)
    # The store asks for each step's experts layer by layer, in ascending id order; LRU keeps
    # the last three distinct ones asked for.
    order = [(layer, e) for layers in reference_steps(tiny_path, 2)
             for layer, experts in enumerate(layers) for e in sorted(experts)]
    kept = []
    for key in reversed(order):
        if key not in kept and len(kept) < 3:
            kept.append(key)
    assert view["tier"] == [["host" if (layer, e) in kept else "disk" for e in range(4)]
                            for layer in range(2)]


def test_without_a_store_or_a_recorder_experts_are_mapped_and_never_seen(tiny_path):
    view = experts_after_one_completion(load(tiny_path), None)
    assert view["tier"] == [["mapped"] * 4, ["mapped"] * 4]
    assert view["step"] is None and view["last_use"] == [[None] * 4, [None] * 4]
    c = view["counters"]
    assert c["generated_tokens"] == N_TOKENS
    assert [c[k] for k in ("expert_requests", "hit_rate", "disk_bytes", "transfer_bytes")] == \
        [None] * 4


def test_the_page_is_served_without_the_key_and_its_data_only_with_it(tiny_path):
    runtime = load(tiny_path)
    app = create_app(runtime, ServerOptions(MODEL, BatchOptions(ctx=CTX), api_key="s3cret"))
    with TestClient(app, base_url=LOCAL) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert '<script src="page.js"></script>' in page.text
        assert 'href="page.css"' in page.text and 'id="key"' in page.text
        assert client.get("/page.js").headers["content-type"] == "text/javascript; charset=utf-8"
        assert client.get("/page.css").headers["content-type"] == "text/css; charset=utf-8"
        assert client.get("/v1/moeswap/experts").status_code == 401
        good = client.get("/v1/moeswap/experts", headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200 and good.json()["n_experts"] == 4
        metrics = client.get("/metrics", headers={"Authorization": "Bearer s3cret"}).text
    assert 'moeswap_requests_total{path="/",code="200"} 1' in metrics
    assert 'moeswap_requests_total{path="/v1/moeswap/experts",code="401"} 1' in metrics


def test_the_page_fetches_nothing_from_elsewhere():
    """Offline: no URL with a scheme or a protocol-relative one in any of the page's files."""
    web = resources.files("moeswap.server") / "web"
    names = sorted(p.name for p in web.iterdir())
    assert names == ["index.html", "page.css", "page.js"]
    for name in names:
        text = (web / name).read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), name
        assert "@import" not in text and "url(" not in text, name
