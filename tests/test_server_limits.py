"""Where a request ends on the server: a full queue answers 429, a cancelled request or a stream
left early leaves the batch, a conversation over the context is refused or cut (keep-recent), and
stop strings cut the reply."""

# ruff: noqa: F811 (test_server's fixtures, imported, are the tests' arguments)
from __future__ import annotations

import asyncio
import threading

import pytest
from test_server import (MODEL, GatedModel, WrappedRuntime, one_thread,  # noqa: F401 (fixtures)
                         runtime, serve, solo_text, tiny_path, wait_until)

from moeswap.context_window import ContextOverflow, fit_context
from moeswap.sampling import GREEDY, Sampler
from moeswap.server.batching import BatchOptions, BatchScheduler
from moeswap.server.choices import StopStrings


def test_full_queue_answers_429(runtime):
    gated = WrappedRuntime(runtime, GatedModel)
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


def test_drain_steps_on_the_callers_thread_as_the_loop_does(runtime):
    """``start(here=True)`` then ``drain``: every request ends, on the calling thread, with
    the tokens the scheduler's own thread gives (3 requests through a batch of 2: one waits)."""
    prompts = [runtime.encode(p) for p in ("ab", "cd", "efg")]

    def run(here: bool) -> tuple[list[list[int]], set]:
        scheduler = BatchScheduler(runtime.model, BatchOptions(max_batch=2, ctx=64))
        tokens, threads = [[] for _ in prompts], set()
        ended = threading.Semaphore(0)

        def on_event(i):
            def record(e):
                threads.add(threading.get_ident())
                if e.token is not None:
                    tokens[i].append(e.token)
                else:
                    ended.release()
            return record

        scheduler.start(here=here)
        try:
            for i, prompt in enumerate(prompts):
                scheduler.submit(prompt, max_tokens=5, sampler=Sampler(GREEDY),
                                 stop_ids=frozenset(), on_event=on_event(i))
            if here:
                scheduler.drain()
            for _ in prompts:
                assert ended.acquire(timeout=60)
        finally:
            scheduler.stop()
        assert not scheduler.alive  # stopped: submit refuses, as after the thread's end
        assert scheduler.counters.requests_finished == {"length": 3}
        return tokens, threads

    drained, drained_on = run(here=True)
    looped, looped_on = run(here=False)
    assert drained == looped and all(len(t) == 5 for t in drained)
    assert drained_on == {threading.get_ident()} and threading.get_ident() not in looped_on


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
