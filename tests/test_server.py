"""The OpenAI-compatible server on a tiny Mixtral-layout GGUF through the real engine:
responses and SSE chunks in OpenAI's shapes, batched greedy decoding equal to one request at
a time, n choices, the metrics; and the helpers the other server tests import. Bad input and
the API key: test_server_bad_requests.py; back-pressure, cancellation, context limits and stop
strings: test_server_limits.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient
from gguf import GGUFValueType as T

import moeswap
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.memory import HostCharge
from moeswap.sampling import GREEDY, Sampler
from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions, BatchScheduler

# Roles become letters the tiny vocabulary has (a..z); the reply starts after "a".
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}a{% endif %}")
INJECTION = "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ messages[0]['content'] }}"
MODEL = "tiny"
LOCAL = "http://127.0.0.1"


def write_model(folder, template: str):
    from gguf_builders import mixtral

    spec = mixtral()
    spec.kv["tokenizer.chat_template"] = (template, T.STRING)
    return spec.write(folder / f"{MODEL}.gguf")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("server"), TEMPLATE)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One kernel thread: ggml's threads wait on each other by spinning, which on a busy
    machine turns millisecond steps into seconds. torch's count is process-wide: restored."""
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def load(path, **options):
    """One kernel thread; the tokenizer cache is the run's temporary one (conftest), never a
    folder beside the model, which for the built-in model is inside the package."""
    return moeswap.load(path, threads=1, **options)


@pytest.fixture(scope="module")
def runtime(tiny_path):
    return load(tiny_path)


class GatedModel:
    """The model, with a gate: forward calls wait until the test opens it; batch sizes recorded."""

    def __init__(self, model):
        self.model = model
        self.gate = threading.Event()
        self.batch_sizes: list[int] = []

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, tokens, caches, last_only=False):
        self.gate.wait(timeout=30)
        self.batch_sizes.append(len(tokens))
        return self.model.forward(tokens, caches, last_only)


class WrappedRuntime:
    """The runtime with its model wrapped by ``wrap`` (GatedModel, a recorder, a delay);
    everything else is the real runtime's."""

    def __init__(self, runtime, wrap):
        self._runtime = runtime
        self.model = wrap(runtime.model)

    def __getattr__(self, name):
        return getattr(self._runtime, name)


def wait_until(condition, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def serve(runtime, **options):
    batch = BatchOptions(**{"max_batch": 8, "queue_size": 16, "ctx": 64, **options.pop("batch", {})})
    # TestClient's default Host, "testserver", is not a local name: the server would refuse it
    return TestClient(create_app(runtime, ServerOptions(MODEL, batch, **options)), base_url=LOCAL)


def solo_text(runtime, prompt_ids, n):
    tokens = list(runtime.generate(prompt_ids, n, temperature=0.0))
    stream = runtime.tokenizer.stream(prompt_ids)
    return "".join(stream.push(t) for t in tokens), len(tokens)


def sse_events(response) -> list:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_models_health_and_greedy_completion(runtime):
    with serve(runtime) as client:
        assert client.get("/health").json()["status"] == "ok"
        models = client.get("/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "abcab",
                                                 "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = runtime.encode("abcab")
    text, used = solo_text(runtime, prompt_ids, 6)
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": "length" if used == 6 else "stop"}]
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": used,
                             "total_tokens": len(prompt_ids) + used,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_completion_and_its_stream_agree(runtime):
    messages = [{"role": "system", "content": "bb"}, {"role": "user", "content": "cdc"}]
    request = {"model": MODEL, "messages": messages, "max_tokens": 7, "temperature": 0}
    with serve(runtime) as client:
        whole = client.post("/v1/chat/completions", json=request).json()
        with client.stream("POST", "/v1/chat/completions",
                           json={**request, "stream": True,
                                 "stream_options": {"include_usage": True}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = sse_events(r)
    prompt_ids = runtime.chat_prompt_ids(messages)
    text, used = solo_text(runtime, prompt_ids, 7)
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert whole["usage"]["prompt_tokens"] == len(prompt_ids)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body = chunks[1:-2]
    assert "".join(c["choices"][0]["delta"]["content"] for c in body) == text
    assert all(c["choices"][0]["finish_reason"] is None for c in body)
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": whole["choices"][0]["finish_reason"]}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == used


def test_streamed_completion_chunks(runtime):
    with serve(runtime) as client:
        with client.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "ddd", "max_tokens": 5, "temperature": 0,
                "stream": True}) as r:
            chunks = sse_events(r)
    text, _ = solo_text(runtime, runtime.encode("ddd"), 5)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_concurrent_requests_are_decoded_together_and_equal_solo_runs(runtime):
    gated = WrappedRuntime(runtime, GatedModel)
    prompts = ["a", "bcdefg", "ccc", "hij"]
    results: dict[int, dict] = {}
    with serve(gated) as client:
        scheduler = client.app.state.scheduler

        def ask(i):
            results[i] = client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompts[i], "max_tokens": 6, "temperature": 0}).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        # the first request is in its (gated) step, the rest queued
        assert wait_until(lambda: scheduler.active_count + scheduler.queue_depth == len(prompts))
        gated.model.gate.set()
        for t in threads:
            t.join()
    for i, prompt in enumerate(prompts):
        assert results[i]["choices"][0]["text"] == solo_text(runtime, runtime.encode(prompt), 6)[0], i
    assert max(gated.model.batch_sizes) == len(prompts)  # all four in one forward call


def test_batched_requests_share_expert_loads(tiny_path, tmp_path):
    """With room for fewer experts than the model has, four requests decoded together read
    fewer expert bytes than the same four one after another, and produce the same tokens."""
    from moeswap.experts.store import shared_bytes
    from moeswap.experts.tiers import slot_bytes
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.models.quant_experts import ExpertLayout

    gguf = GGUFFile.open(tiny_path)
    config = config_from_gguf(gguf)
    slot = slot_bytes([ExpertLayout.from_file(gguf, i) for i in config.moe_layers])
    ctx, n = 32, 4
    charge = HostCharge.for_sequence(ctx * n)
    fixed = charge.bytes(config, shared_bytes(gguf, config.moe_layers),
                         config.n_expert_used * slot)
    host = fixed + 3 * slot  # 3 of the 8 experts

    def run(together: bool):
        factory = build_store(OffloadSettings(host_bytes=host), charge)
        store_runtime = load(tiny_path, expert_runner=factory)
        prompts = [store_runtime.encode(p) for p in ("ab", "cdcd", "efg", "hhh")]
        outputs = {}
        scheduler = BatchScheduler(store_runtime.model, BatchOptions(max_batch=n, ctx=ctx))
        scheduler.start()
        done = [threading.Event() for _ in prompts]
        for i, ids in enumerate(prompts):
            outputs[i] = []

            def on_event(e, i=i):
                if e.token is not None:
                    outputs[i].append(e.token)
                else:
                    done[i].set()

            scheduler.submit(ids, max_tokens=8, sampler=Sampler(GREEDY), stop_ids=frozenset(),
                             on_event=on_event)
            if not together:
                done[i].wait(30)
        for d in done:
            d.wait(30)
        scheduler.stop()
        return outputs, factory.stats()["total"]["disk_bytes"]

    batched, batched_bytes = run(True)
    sequential, sequential_bytes = run(False)
    assert batched == sequential
    assert 0 < batched_bytes < sequential_bytes


def test_n_choices_with_seeds(runtime):
    request = {"model": MODEL, "prompt": "ab", "max_tokens": 6, "n": 3, "seed": 7, "temperature": 1.5}
    with serve(runtime) as client:
        first = client.post("/v1/completions", json=request).json()
        again = client.post("/v1/completions", json=request).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert first["choices"] == again["choices"]  # seeded: reproducible


def test_metrics_show_server_and_expert_store_series(tiny_path):
    factory = build_store(OffloadSettings(host_bytes=2**30), HostCharge.for_sequence(64 * 8))
    store_runtime = load(tiny_path, expert_runner=factory)
    with serve(store_runtime) as client:
        client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 3,
                                             "temperature": 0})
        text = client.get("/metrics").text
    assert 'moeswap_requests_total{path="/v1/completions",code="200"} 1' in text
    assert "moeswap_generated_tokens_total " in text and "moeswap_queue_depth 0" in text
    assert "moeswap_expert_hit_rate " in text
    assert 'moeswap_tier_resident_bytes{tier="host"} ' in text
