"""--step-tokens: a forward step carries at most that many tokens, running requests' next
tokens first, prompts cut into chunks over several steps (chunked prefill), with the same
greedy output as each request alone; and the settings that cannot work are refused."""

from __future__ import annotations

import threading

import pytest

from moeswap.errors import MoeswapError
from moeswap.memory import HostCharge
from moeswap.sampling import GREEDY, Sampler
from moeswap.server.batching import BatchOptions, BatchScheduler
from test_server import TEMPLATE, load, one_thread, write_model  # noqa: F401


class CountingModel:
    """The model, recording each forward call's tokens per sequence; held until ``go`` is set."""

    def __init__(self, model):
        self.model = model
        self.go = threading.Event()
        self.calls: list[list[int]] = []

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, tokens, caches, last_only=False):
        self.go.wait(timeout=30)
        self.calls.append([int(t.numel()) for t in tokens])
        return self.model.forward(tokens, caches, last_only)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return load(write_model(tmp_path_factory.mktemp("chunks"), TEMPLATE))


def test_prompts_are_prefilled_in_chunks_behind_running_requests(runtime):
    long, short = runtime.encode("abcdefg"), runtime.encode("hijk")
    assert (len(long), len(short)) == (8, 5)  # with BOS
    model = CountingModel(runtime.model)
    scheduler = BatchScheduler(model, BatchOptions(max_batch=2, ctx=32, step_tokens=3))
    scheduler.start()
    outputs, done = {0: [], 1: []}, [threading.Event(), threading.Event()]
    for i, ids in enumerate((long, short)):
        def on_event(e, i=i):
            if e.token is not None:
                outputs[i].append(e.token)
            if e.finish_reason is not None or e.error is not None:
                done[i].set()
        scheduler.submit(ids, max_tokens=4, sampler=Sampler(GREEDY), stop_ids=frozenset(),
                         on_event=on_event)
    model.go.set()
    assert all(d.wait(30) for d in done)
    scheduler.stop()
    # The long prompt first, 3 tokens a step; once it decodes, its token goes first and the
    # short prompt gets the other 2; then both decode. The first step may have run before the
    # short request joined: it is the same either way, the long prompt takes all 3 tokens.
    assert model.calls == [[3], [3], [2, 1], [1, 2], [1, 2], [1, 1], [1], [1]]
    assert all(sum(call) <= 3 for call in model.calls)
    for i, ids in enumerate((long, short)):
        tokens = list(runtime.generate(ids, 4, temperature=0.0))
        assert outputs[i] == tokens


@pytest.mark.parametrize("options, message", [
    ({"step_tokens": 0}, "--step-tokens must be >= 1, got 0"),
    ({"max_batch": 8, "step_tokens": 4}, "--step-tokens 4 is below --max-batch 8"),
])
def test_step_tokens_that_cannot_work_are_refused(options, message):
    with pytest.raises(MoeswapError, match=message):
        BatchOptions(**options)


def test_a_batch_charges_its_contexts_and_a_steps_working_memory(tmp_path):
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.server.budget import batch_charge

    # the tiny model: vocabulary 32, 4 query heads, width 64, 512 bytes of KV per position
    config = config_from_gguf(GGUFFile.open(write_model(tmp_path, TEMPLATE)))
    options = BatchOptions(max_batch=2, ctx=32, step_tokens=4)
    # 4 bytes x (2 x 4 x 32 scores + 16 x 64 activations) per fed token, and 2 x 32 per logits
    # row: one per sequence the step feeds (at most the batch's two)
    charge = batch_charge(options)
    assert charge == HostCharge(context_tokens=32, sequences=2, step_tokens=4)
    assert charge.working_bytes(config) == 4 * (4 * (256 + 1024) + 2 * 64) == 20992
    assert charge.kv_bytes(config) + charge.working_bytes(config) == 2 * 32 * 512 + 20992 == 53760
    odd = batch_charge(BatchOptions(max_batch=2, ctx=32, step_tokens=5))
    assert odd.kv_bytes(config) + odd.working_bytes(config) == 64 * 512 + 4 * (5 * 1280 + 2 * 64)
