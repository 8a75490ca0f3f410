"""The OpenAI-compatible server on a tiny Mixtral-layout GGUF through the real engine:
responses and SSE chunks in OpenAI's shapes, batched greedy decoding equal to one request at
a time, the API key, back-pressure, cancellation, context limits, and a 4xx for bad input."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient
from gguf import GGUFValueType as T
from hypothesis import HealthCheck, event, given, settings, strategies as st

import moeswap
from moeswap.context_window import ContextOverflow, fit_context
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.memory import HostCharge
from moeswap.sampling import GREEDY, Sampler
from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions, BatchScheduler
from moeswap.server.choices import StopStrings

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


class GatedRuntime:
    """A runtime whose model is gated; everything else is the real runtime's."""

    def __init__(self, runtime):
        self._runtime = runtime
        self.model = GatedModel(runtime.model)

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
    gated = GatedRuntime(runtime)
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


def test_full_queue_answers_429(runtime):
    gated = GatedRuntime(runtime)
    statuses = []
    with serve(gated, batch={"max_batch": 1, "queue_size": 1}) as client:
        scheduler = client.app.state.scheduler

        def ask():
            statuses.append(client.post("/v1/completions", json={
                "model": MODEL, "prompt": "a", "max_tokens": 2}).status_code)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        threads[0].start()  # the batch's one slot: its step waits at the gate
        assert wait_until(lambda: scheduler.active_count == 1)
        threads[1].start()  # the queue's one place
        assert wait_until(lambda: scheduler.queue_depth == 1)
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        gated.model.gate.set()
        for t in threads:
            t.join()
        assert statuses == [200, 200]
        assert 'moeswap_rejected_total 1' in client.get("/metrics").text


def test_cancelled_request_leaves_the_batch_and_drops_its_cache(runtime):
    gated = GatedModel(runtime.model)
    scheduler = BatchScheduler(gated, BatchOptions(max_batch=4, ctx=64))
    events = {0: [], 1: []}
    finished = [threading.Event(), threading.Event()]

    def on_event(i):
        def record(e):
            events[i].append(e)
            if e.finish_reason is not None or e.error is not None:
                finished[i].set()
        return record

    scheduler.start()
    try:
        requests = [scheduler.submit(runtime.encode(p), max_tokens=20, sampler=Sampler(GREEDY),
                                     stop_ids=frozenset(), on_event=on_event(i))
                    for i, p in enumerate(("ab", "cd"))]
        requests[0].cancel()
        gated.gate.set()
        assert finished[0].wait(30) and finished[1].wait(30)
    finally:
        scheduler.stop()
    assert events[0][-1].finish_reason == "cancelled"
    assert requests[0].cache is None and requests[1].cache is None
    assert [e.token is not None for e in events[1]].count(True) == 20
    assert events[1][-1].finish_reason == "length"
    assert scheduler.counters.requests_finished == {"cancelled": 1, "length": 1}


def test_leaving_a_stream_early_cancels_its_requests(runtime):
    from moeswap.sampling import SamplingParams
    from moeswap.server.choices import Choices

    scheduler = BatchScheduler(runtime.model, BatchOptions(ctx=64))
    scheduler.start()

    async def first_piece_then_leave():
        choices = Choices(scheduler, runtime.tokenizer, runtime.encode("ab"), n=2, max_tokens=50,
                          params=SamplingParams(temperature=0.0), stops=[])
        pieces = choices.pieces()
        await pieces.__anext__()
        await pieces.aclose()
        return choices.requests

    try:
        requests = asyncio.run(first_piece_then_leave())
        assert all(r.cancelled for r in requests)
        assert wait_until(lambda: scheduler.active_count == 0)
        assert all(r.generated < 50 for r in requests)
    finally:
        scheduler.stop()


def test_context_policy_keeps_the_start_and_the_most_recent_tokens():
    ids = list(range(100))
    assert fit_context(ids[:10], 16, max_tokens=4, policy="error", keep_prefix=0) == ids[:10]
    with pytest.raises(ContextOverflow, match="100 tokens but the context holds 16"):
        fit_context(ids, 16, max_tokens=4, policy="error")
    # room for the reply: max_tokens, at most half the context
    assert fit_context(ids, 16, max_tokens=4, policy="keep-recent", keep_prefix=3) == \
        [0, 1, 2] + ids[-9:]
    assert fit_context(ids, 16, max_tokens=100, policy="keep-recent", keep_prefix=1) == \
        [0] + ids[-7:]
    with pytest.raises(ContextOverflow, match="system prompt"):
        fit_context(ids, 16, max_tokens=4, policy="keep-recent", keep_prefix=12)


def test_server_keep_recent_policy_accepts_a_long_conversation(runtime):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "bc" * 40}]
    with serve(runtime, ctx_policy="keep-recent") as client:
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                      "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 64 - 4


def test_stop_strings_are_cut_and_held_back():
    cut = StopStrings(["xyz"])
    assert cut.push("abx") == "ab"  # "x" may start the stop string
    assert cut.push("y") == ""
    assert cut.push("q") == "xyq"
    assert cut.push("1xyz2") == "1" and cut.stopped


def test_stop_string_ends_a_completion(runtime):
    full, _ = solo_text(runtime, runtime.encode("abcab"), 8)
    stop = full[3:5]
    with serve(runtime) as client:
        body = client.post("/v1/completions", json={"model": MODEL, "prompt": "abcab", "max_tokens": 8,
                                                     "temperature": 0, "stop": stop}).json()
    assert body["choices"][0]["text"] == full[:full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_n_choices_with_seeds(runtime):
    request = {"model": MODEL, "prompt": "ab", "max_tokens": 6, "n": 3, "seed": 7, "temperature": 1.5}
    with serve(runtime) as client:
        first = client.post("/v1/completions", json=request).json()
        again = client.post("/v1/completions", json=request).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert first["choices"] == again["choices"]  # seeded: reproducible


def test_template_injection_is_stopped_by_the_sandbox(tmp_path):
    evil = load(write_model(tmp_path, INJECTION))
    with serve(evil) as client:
        r = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 400 and "sandbox" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200


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
    broken = GatedRuntime(runtime)
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
    fake = GatedRuntime(runtime)
    fake.model = CountingModel(runtime.tokenizer.vocab_size)
    with serve(fake, batch={"ctx": 16}) as client:
        yield client
