"""Simulation semantics chosen explicitly (issue 26): the order requests come in (forward
passes recorded and imported), slots in total beside experts per layer, Belady with and
without bypass, capacities that hold a whole layer, four decimals, the published CSV shape,
and a profile whose window search is bounded."""

from __future__ import annotations

import numpy as np
import pytest

from moeswap.cli import main
from moeswap.routing import policies, profile
from moeswap.routing.importers import import_trace
from moeswap.routing.policy_specs import simulate_grid
from moeswap.routing.traces import RoutingTrace


def two_layer_trace() -> RoutingTrace:
    """Four tokens, two layers of four experts, top-1: layer 0 asks 0 1 0 1, layer 1 2 3 2 3."""
    ids = np.array([[[0], [2]], [[1], [3]], [[0], [2]], [[1], [3]]])  # [T 4, L 2, k 1]
    return RoutingTrace(model="hand", arch="test", layers=[0, 1], n_experts=4, k=1,
                        prompt_offsets=[0, 4], expert_ids=ids, weights=np.full(ids.shape, 0.5))


def hits(trace, spec, capacities, scope, slots=False) -> list[int]:
    return [int(r.hits.sum()) for r in simulate_grid(trace, [spec], capacities, scope, slots)]


def batched_trace(forward=(0, 0)) -> RoutingTrace:
    """Two tokens, two layers of four experts, top-2: layer 0 picks [0, 1] and [1, 2], layer 1
    [3, 0] and [0, 3]; ``forward`` gives each token's forward pass."""
    ids = np.array([[[0, 1], [3, 0]], [[1, 2], [0, 3]]])  # [T 2, L 2, k 2]
    return RoutingTrace(model="hand", arch="test", layers=[0, 1], n_experts=4, k=2,
                        prompt_offsets=[0, 2], expert_ids=ids, weights=np.full(ids.shape, 0.5),
                        forward=np.array(forward))


def test_the_order_of_requests_is_chosen_explicitly():
    """One forward of both tokens, a global LRU of 2 slots. Token order: (0,0) (0,1) (1,3)
    (1,0) (0,1) (0,2) (1,0) (1,3): every request evicts what comes next, no hit. Layer order:
    (0,0) (0,1) (0,1) (0,2) (1,3) (1,0) (1,0) (1,3): three hits. Step order, as the store
    counts: (0,0) (0,1) (0,2) (1,0) (1,3), each once, no hit."""
    from moeswap.routing.simulate import global_requests, layer_requests

    trace = batched_trace()
    assert global_requests(trace, "layer")[:4] == [(0, 0), (0, 1), (0, 1), (0, 2)]
    assert global_requests(trace, "step") == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 3)]
    assert layer_requests(trace, 0, "token") == layer_requests(trace, 0, "layer") == [0, 1, 1, 2]
    found = {order: [(int(r.hits.sum()), int(r.requests.sum()))
                     for r in simulate_grid(trace, ["lru"], [2], "global", True, order)]
             for order in ("token", "layer", "step")}
    assert found == {"token": [(0, 8)], "layer": [(3, 8)], "step": [(0, 5)]}
    # one token per forward: the same requests in every order, a layer's in ascending id in step
    apart = batched_trace(forward=(0, 1))
    assert global_requests(apart, "step") == [(0, 0), (0, 1), (1, 0), (1, 3),
                                              (0, 1), (0, 2), (1, 0), (1, 3)]
    assert global_requests(apart, "layer") == global_requests(apart, "token")


def test_forward_passes_are_recorded_kept_and_implied_for_old_traces(tmp_path):
    import torch

    from moeswap.routing.recorder import RoutingRecorder

    recorder, cache_a, cache_b = RoutingRecorder(), object(), object()
    picks = torch.tensor([[0, 1], [1, 2], [2, 3]])  # [N 3, K 2]
    recorder.begin_forward([(0, 2), (2, 3)], [0, 0], [cache_a, cache_b])  # two prompts at once
    recorder.record(0, picks, torch.full((3, 2), 0.5), None)
    recorder.begin_forward([(0, 1)], [2], [cache_a])  # then a decode step of the first
    recorder.record(0, picks[:1], torch.full((1, 2), 0.5), None)
    trace = recorder.trace(model="m", arch="a", layers=[0], n_experts=4, k=2)
    assert trace.forward.tolist() == [0, 0, 1, 0]  # prompt a (2 + 1 decode), then prompt b
    trace.save(tmp_path / "t.npz")
    assert RoutingTrace.load(tmp_path / "t.npz").forward.tolist() == [0, 0, 1, 0]
    old = RoutingTrace.load(tmp_path / "t.npz")
    old.forward = None  # a trace from before forward passes were recorded: implied by phase
    assert old.phase.tolist() == [0, 0, 1, 0] and old.forwards().tolist() == [0, 0, 1, 2]


def test_slots_count_the_whole_budget():
    trace = two_layer_trace()
    # per layer: one expert each misses every time; two each hit the 2nd use of both experts
    assert hits(trace, "lru", [1, 2], "per-layer") == [0, 4]
    # 3 slots shared out: layer 0 gets 2 (2 hits), layer 1 gets 1 (none); 4 slots: 2 each
    assert hits(trace, "lru", [3, 4], "per-layer", slots=True) == [2, 4]
    # one global cache of N slots sees (0,0) (1,2) (0,1) (1,3) twice: 2 slots never hit
    assert hits(trace, "lru", [2, 4], "global", slots=True) == [0, 4]
    assert hits(trace, "lru", [1, 2], "global") == [0, 4]  # capacity x L, as before


def test_belady_may_bypass_and_belady_admit_may_not():
    stream = ["a", "b", "a"]
    bypass = policies.Belady(1, stream)
    assert [bypass.access(k).hit for k in stream] == [False, False, True]  # b stays out
    from moeswap.routing.policy_specs import BeladyAdmit

    admit = BeladyAdmit(1, stream)
    assert [admit.access(k).hit for k in stream] == [False, False, False]  # b evicts a


def test_capacity_that_holds_a_layer_is_warned_about_and_rates_have_four_decimals(tmp_path,
                                                                                capsys):
    trace = two_layer_trace()
    path = tmp_path / "t.npz"
    trace.save(path)
    assert main(["simulate", str(path), "--policy", "lru,belady,belady-admit",
                 "--capacity", "1,4"]) == 0
    out, err = capsys.readouterr()
    assert "warning: capacity 4 (experts per layer) holds all 4 experts" in err
    assert "capacity 1 " not in err
    assert "0.00%" in out and "50.00%" in out  # capacity 4: the second use of each is a hit
    assert main(["simulate", str(path), "--slots", "3,8", "--global", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "capacity 8 (slots in total)" in err and "capacity 3 " not in err


def published_csv(path, rng) -> tuple[int, int]:
    """A CSV of the published shape: '# phase,n_tokens,layer,token_idx,e0..e7', 26 layers of
    256 experts, top-8, two prefill batches of hundreds of tokens, then decode steps."""
    lines = ["# phase,n_tokens,layer,token_idx," + ",".join(f"e{i}" for i in range(8))]
    batches = [("prefill", 233), ("prefill", 150)] + [("decode", 1)] * 5
    for phase, n in batches:
        for layer in range(26):
            for token in range(n):
                experts = rng.choice(256, 8, replace=False)
                lines.append(f"{phase},{n},{layer},{token}," + ",".join(map(str, experts)))
    path.write_text("\n".join(lines) + "\n")
    return sum(n for _, n in batches), len(lines) - 1


def test_a_published_shape_csv_imports_with_its_commented_header(tmp_path):
    n_tokens, n_rows = published_csv(tmp_path / "published.csv", np.random.default_rng(0))
    trace = import_trace(tmp_path / "published.csv")
    assert (trace.n_tokens, trace.n_layers, trace.n_experts, trace.k) == (n_tokens, 26, 256, 8)
    assert int(trace.valid.sum()) * 8 == n_rows * 8 == 26 * n_tokens * 8
    # a prefill batch after a prefill batch continues the prompt: one prompt in all
    assert trace.n_prompts == 1
    # each batch is one forward pass: 233 and 150 prefill tokens, then 5 decode steps
    assert np.bincount(trace.forward).tolist() == [233, 150, 1, 1, 1, 1, 1]


def test_profile_scores_a_bounded_number_of_capacities(monkeypatch):
    assert profile.scored_capacities(8, 256) == [9, 58, 107, 157, 206, 255]
    assert profile.scored_capacities(2, 8) == [3, 4, 5, 6, 7]
    assert profile.scored_capacities(2, 3) == []
    rng = np.random.default_rng(1)
    ids = np.stack([np.stack([rng.choice(64, 4, replace=False) for _ in range(2)])
                    for _ in range(40)])  # [T 40, L 2, k 4] of 64 experts
    trace = RoutingTrace(model="r", arch="test", layers=[0, 1], n_experts=64, k=4,
                         prompt_offsets=[0, 40], expert_ids=ids, weights=np.full(ids.shape, .25))
    calls = []
    simulate = profile.simulate
    monkeypatch.setattr(profile, "simulate", lambda *a, **kw: calls.append(a[3]) or simulate(*a))
    profile.build_profile(trace, 4, per_layer=False)
    assert len(calls) == len(profile.WINDOW_CHOICES) * 2 * profile.SCORED_CAPACITIES
    calls.clear()
    assert profile.build_profile(trace, 4, per_layer=False, window=16).reuse.window == 16
    assert calls == []  # a given window is not searched


def test_profile_window_flag(tmp_path, capsys):
    path = tmp_path / "t.npz"
    two_layer_trace().save(path)
    assert main(["profile", str(path), "--budget", "2", "--window", "8",
                 "-o", str(tmp_path / "p.json")]) == 0
    assert profile.Profile.load(tmp_path / "p.json").reuse.window == 8
    with pytest.raises(SystemExit):
        main(["profile", str(path), "--budget", "2", "--window", "x", "-o", "p.json"])
