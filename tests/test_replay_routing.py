"""--replay-routing: a recorded trace's decisions replace the router's, exactly as specified
(trace layer i -> MoE layer i, position t -> trace token t mod R, 1/k where weights are
missing); mismatched traces are refused by name; budgets keep the logits bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_builders import qwen3moe
from moeswap.errors import MoeswapError
from moeswap.experts.store import shared_bytes
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.tiers import slot_bytes
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models import load_model
from moeswap.models.quant_experts import ExpertLayout, QuantResidentExperts
from moeswap.routing.recorder import RoutingRecorder
from moeswap.routing.replay import RoutingReplay
from moeswap.routing.traces import NO_EXPERT, RoutingTrace

E, K, LAYERS = 8, 2, 2  # the Qwen3-MoE builder's model: 8 experts top-2, 2 MoE layers, Q8_0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return qwen3moe().write(tmp_path_factory.mktemp("replay") / "qwen3moe.gguf")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """torch's thread count is process-wide: one thread here, restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def write_trace(path, n_tokens: int = 10, n_layers: int = 3, n_experts: int = E, k: int = K,
                seed: int = 0) -> RoutingTrace:
    """Random distinct picks and random weights (not summing to 1, so they are recognisable)."""
    rng = np.random.default_rng(seed)
    ids = np.array([[rng.choice(n_experts, k, replace=False) for _ in range(n_layers)]
                    for _ in range(n_tokens)])  # [T, L, k]
    trace = RoutingTrace(model="recorded-model", arch="llama", layers=list(range(n_layers)),
                         n_experts=n_experts, k=k, prompt_offsets=[0, n_tokens], expert_ids=ids,
                         weights=rng.random(ids.shape).astype(np.float32))
    trace.save(path)
    return trace


class Spy:
    """An expert-runner factory around another that logs every run() call's decisions."""

    def __init__(self, factory):
        self.factory, self.calls = factory, []
        self.stats = getattr(factory, "stats", None)

    def __call__(self, *args):
        runner = self.factory(*args)
        run = runner.run

        def logged(layer, x, ids, weights):
            self.calls.append((layer, ids.clone(), weights.clone()))
            return run(layer, x, ids, weights)

        runner.run = logged
        return runner


def store_factory(path, experts_per_layer: int, **options):
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    slot = slot_bytes([ExpertLayout.from_file(gguf, i) for i in config.moe_layers])
    fixed = shared_bytes(gguf, config.moe_layers) + config.n_expert_used * slot
    return build_store(OffloadSettings(
        host_bytes=fixed + experts_per_layer * LAYERS * slot, **options))


PROMPT = torch.tensor([5, 9, 7, 11])


def prefill_and_decode(model, steps: int = 8) -> torch.Tensor:
    """Prefill of 4 tokens, then ``steps`` decode steps fed back greedily: logits [4 + steps, V]."""
    cache = model.new_cache()
    parts = [model.forward([PROMPT], [cache])[0]]
    for _ in range(steps):
        parts.append(model.forward([parts[-1][-1:].argmax(-1)], [cache])[0])
    return torch.cat(parts)


def test_the_store_is_asked_for_exactly_the_traces_experts(model_path, tmp_path):
    trace = write_trace(tmp_path / "t.npz")
    spy = Spy(store_factory(model_path, 1, policy="lru", cold_reads=True))
    model = load_model(model_path, threads=1, expert_runner=spy,
                       replay=RoutingReplay.load(tmp_path / "t.npz"))
    prefill_and_decode(model)  # 12 positions over a 10-token trace: positions 10, 11 wrap
    forwards = [range(0, 4)] + [range(p, p + 1) for p in range(4, 12)]
    expected_ids, expected_weights, requests = [], [], 0
    for positions in forwards:
        rows = [p % trace.n_tokens for p in positions]
        for layer in range(LAYERS):
            expected_ids.append(trace.expert_ids[rows, layer].astype(np.int64))
            expected_weights.append(trace.weights[rows, layer])
            requests += len(np.unique(trace.expert_ids[rows, layer]))
    assert [layer for layer, _, _ in spy.calls] == [0, 1] * len(forwards)
    for (_, ids, weights), want_ids, want_weights in zip(spy.calls, expected_ids, expected_weights):
        assert np.array_equal(ids.numpy(), want_ids)
        assert np.array_equal(weights.numpy(), want_weights)
    stats = spy.stats()
    assert stats["total"]["requests"] == requests  # the store counted the trace's experts
    # The router itself picks otherwise, so replay really replaced it.
    recorder = RoutingRecorder()
    prefill_and_decode(load_model(model_path, threads=1, recorder=recorder))
    own = recorder.trace(model="m", arch="qwen3moe", layers=[0, 1], n_experts=E, k=K)
    assert not np.array_equal(own.expert_ids[:10, :LAYERS], trace.expert_ids[:10, :LAYERS])


def test_batch_rows_take_their_own_positions(model_path, tmp_path):
    trace = write_trace(tmp_path / "t.npz", n_tokens=5)
    spy = Spy(QuantResidentExperts)
    model = load_model(model_path, threads=1, expert_runner=spy,
                       replay=RoutingReplay.load(tmp_path / "t.npz"))
    a, b = model.new_cache(), model.new_cache()
    model.forward([torch.tensor([3, 4, 5])], [a])  # sequence a at positions 0-2
    spy.calls.clear()
    model.forward([torch.tensor([6, 7]), torch.tensor([8, 9, 10])], [a, b])  # a: 3, 4; b: 0-2
    rows = [3, 4, 0, 1, 2]
    for layer, ids, _ in spy.calls:
        assert np.array_equal(ids.numpy(), trace.expert_ids[rows, layer])


def test_unrecorded_tokens_are_skipped_missing_weights_are_uniform(model_path, tmp_path):
    trace = write_trace(tmp_path / "full.npz", n_tokens=6)
    trace.expert_ids[2, 1] = NO_EXPERT  # unrecorded at a used layer: the token is skipped
    trace.expert_ids[4, 2] = NO_EXPERT  # only at trace layer 2, which the model does not use
    trace.weights[3, 0, 1] = np.nan  # a weight missing: 1/k for both picks of (token 3, layer 0)
    trace.save(tmp_path / "holes.npz")
    spy = Spy(QuantResidentExperts)
    replay = RoutingReplay.load(tmp_path / "holes.npz")
    model = load_model(model_path, threads=1, expert_runner=spy, replay=replay)
    model.forward([torch.arange(3, 10)], [model.new_cache()])  # positions 0-6: rows wrap at 5
    kept = [0, 1, 3, 4, 5, 0, 1]
    for layer, ids, weights in spy.calls:
        assert np.array_equal(ids.numpy(), trace.expert_ids[kept, layer])
        want = trace.weights[kept, layer].copy()
        if layer == 0:
            want[2] = 1 / K  # token 3 (batch row 2) lacks weights at layer 0 only
        assert np.array_equal(weights.numpy(), want)
    assert replay.stats() == {
        "mode": "replayed", "trace": str(tmp_path / "holes.npz"), "trace_model": "recorded-model",
        "trace_layers": 3, "layers_used": 2, "rows": 5, "rows_skipped": 1,
        "uniform_weight_rows": 1, "decisions": 14}


@pytest.mark.parametrize("shape, says", [
    (dict(n_experts=4), "routes over 4 experts per layer, {model} has 8"),
    (dict(k=3), "picks 3 experts per token, {model} uses 2"),
    (dict(n_layers=1), "has 1 MoE layers, {model} has 2"),
])
def test_a_trace_of_another_shape_is_refused_by_name(model_path, tmp_path, shape, says):
    trace_path = tmp_path / "other.npz"
    write_trace(trace_path, **shape)
    with pytest.raises(MoeswapError) as error:
        load_model(model_path, threads=1, replay=RoutingReplay.load(trace_path))
    message = str(error.value)
    assert message.startswith(f"{trace_path}: the trace ")
    assert says.format(model=model_path) in message
    assert "moeswap trace" in message and "moeswap import-trace" in message


def test_a_recorder_beside_the_replay_gets_the_replayed_decisions(model_path, tmp_path):
    trace = write_trace(tmp_path / "t.npz")
    recorder = RoutingRecorder(router_probs=True)
    model = load_model(model_path, threads=1, recorder=recorder,
                       replay=RoutingReplay.load(tmp_path / "t.npz"))
    prefill_and_decode(model)  # 12 positions: rows 0-9, then 0-1 again
    got = recorder.trace(model="m", arch="qwen3moe", layers=[0, 1], n_experts=E, k=K)
    rows = [p % trace.n_tokens for p in range(12)]
    assert np.array_equal(got.expert_ids, trace.expert_ids[rows, :LAYERS])
    assert np.array_equal(got.weights, trace.weights[rows, :LAYERS])
    assert got.router_probs is None  # the router's distribution is not what ran


def test_unreadable_traces_are_refused(model_path, tmp_path):
    with pytest.raises(MoeswapError, match="no such trace file"):
        RoutingReplay.load(tmp_path / "absent.npz")
    (tmp_path / "text.npz").write_text("not a trace")
    with pytest.raises(MoeswapError, match="moeswap import-trace"):
        RoutingReplay.load(tmp_path / "text.npz")
    trace = write_trace(tmp_path / "t.npz", n_tokens=3)
    trace.expert_ids[:, 0] = NO_EXPERT
    trace.save(tmp_path / "empty.npz")
    with pytest.raises(MoeswapError, match="nothing to replay"):
        load_model(model_path, threads=1, replay=RoutingReplay.load(tmp_path / "empty.npz"))


@pytest.mark.parametrize("experts_per_layer, policy, miss", [
    (1, "lru", "compute"), (2, "lfu", "auto"), (3, "window:4", "compute"), (E, "lru", "auto")])
def test_replay_with_budgets_gives_the_resident_replays_logits(model_path, tmp_path,
                                                               experts_per_layer, policy, miss):
    write_trace(tmp_path / "t.npz", n_tokens=7, seed=3)
    resident = load_model(model_path, threads=1, expert_runner=QuantResidentExperts,
                          replay=RoutingReplay.load(tmp_path / "t.npz"))
    expected = prefill_and_decode(resident)
    factory = store_factory(model_path, experts_per_layer, policy=policy, miss=miss)
    model = load_model(model_path, threads=1, expert_runner=factory,
                       replay=RoutingReplay.load(tmp_path / "t.npz"))
    assert torch.equal(prefill_and_decode(model), expected)
    plain = prefill_and_decode(load_model(model_path, threads=1, expert_runner=QuantResidentExperts))
    assert not torch.equal(plain, expected)  # the replayed routing changed the output


def test_run_and_the_api_say_replayed(model_path, tmp_path, capsys):
    import moeswap
    from moeswap.cli import main

    write_trace(tmp_path / "t.npz")
    runtime = moeswap.load(model_path, threads=1, replay_routing=tmp_path / "t.npz")
    list(runtime.generate("abc", 3, temperature=0.0))
    assert runtime.stats()["routing"]["mode"] == "replayed"
    base = ["run", str(model_path), "-p", "abc", "-n", "3", "--temp", "0", "--threads", "1",
            "--replay-routing", str(tmp_path / "t.npz")]
    assert main(base) == 0
    err = capsys.readouterr().err
    assert f"routing: REPLAYED from {tmp_path / 't.npz'} (recorded-model; trace layers 0-1 of 3" in err
    assert main(base + ["--host-mem", "64MiB"]) == 0
    err = capsys.readouterr().err
    assert err.index("routing: REPLAYED") < err.index("experts: ")
    write_trace(tmp_path / "k3.npz", k=3)
    assert main(base[:-1] + [str(tmp_path / "k3.npz")]) == 2
    assert "picks 3 experts per token" in capsys.readouterr().err
