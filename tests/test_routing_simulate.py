"""Simulator scopes, profiles, the CLI commands, and the learned policy against LRU on the real traces."""

from __future__ import annotations

import json

import numpy as np
import pytest
from real_traces import MIXTRAL, STDLIB_DOCS, needs_mixtral

from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.routing.policies import LRU, LearnedReuse
from moeswap.routing.importers import import_trace
from moeswap.routing.profile import WINDOW_CHOICES, Profile, build_profile, choose_window, halves, hot_set, learn_reuse_table
from moeswap.routing.policy_specs import simulate_grid
from moeswap.routing.simulate import global_requests, layer_requests, simulate
from moeswap.routing.traces import RoutingTrace



def two_layer_trace() -> RoutingTrace:
    ids = [[[0], [1]], [[1], [1]], [[0], [-1]], [[0], [2]]]
    return RoutingTrace(model="m", arch="x", layers=[2, 4], n_experts=3, k=1, prompt_offsets=[0, 4],
                        expert_ids=ids, weights=np.ones((4, 2, 1)))


def test_request_streams_per_layer_and_global():
    t = two_layer_trace()
    assert layer_requests(t, 0) == [0, 1, 0, 0] and layer_requests(t, 1) == [1, 1, 2]
    assert global_requests(t) == [(0, 0), (1, 1), (0, 1), (1, 1), (0, 0), (0, 0), (1, 2)]


def test_simulate_counts_hits_per_layer():
    t = two_layer_trace()
    lru = lambda ctx: LRU(ctx.capacity)  # noqa: E731
    per_layer = simulate(t, "lru", lru, 1, "per-layer")
    assert per_layer.hits.tolist() == [1, 1] and per_layer.requests.tolist() == [4, 3]
    shared = simulate(t, "lru", lru, 1, "global")  # 2 slots for both layers
    # (0,0) m, (1,1) m, (0,1) m evicts (0,0), (1,1) H, (0,0) m evicts (0,1), (0,0) H, (1,2) m
    assert shared.hits.tolist() == [1, 1] and shared.hit_rate == pytest.approx(2 / 7)


def test_profile_hot_sets_and_round_trip(tmp_path):
    counts = np.array([[5, 1, 0], [2, 9, 3]])
    assert hot_set(counts, 3, per_layer=False) == [(1, 1), (0, 0), (1, 2)]
    assert hot_set(counts, 1, per_layer=True) == [(1, 1), (0, 0)]
    profile = build_profile(two_layer_trace(), 2, per_layer=False)
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded.hot == [(0, 0), (1, 1)] and loaded.reuse == profile.reuse
    assert json.loads((tmp_path / "p.json").read_text())["hot"] == {"2": [0], "4": [1]}


def test_unknown_policy_and_mismatched_profile_are_user_errors(tmp_path):
    t = two_layer_trace()
    with pytest.raises(MoeswapError, match="unknown policy 'mru'"):
        list(simulate_grid(t, ["mru"], [1], "per-layer"))
    other = RoutingTrace(model="m", arch="x", layers=[0], n_experts=3, k=1, prompt_offsets=[0, 1],
                         expert_ids=[[[0]]], weights=[[[1.0]]])
    build_profile(other, 1, per_layer=True).save(tmp_path / "other.json")
    with pytest.raises(MoeswapError, match="profile is for layers"):
        list(simulate_grid(t, [f"pinned:{tmp_path / 'other.json'}"], [1], "per-layer"))


def test_cli_commands_end_to_end(tmp_path, capsys):
    src = tmp_path / "run.csv"
    rows = [f"decode,1,{layer},0,{(t * 3 + layer) % 4},{(t + 1) % 4}" for t in range(12) for layer in (0, 1)]
    src.write_text("phase,n_tokens,layer,token_idx,e0,e1\n" + "\n".join(rows) + "\n")
    trace = tmp_path / "run.npz"
    assert main(["import-trace", str(src), "-o", str(trace), "--experts", "4"]) == 0
    assert main(["profile", str(trace), "--budget", "1", "--per-layer", "-o", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    assert main(["simulate", str(trace), "--policy", f"lru,belady,learned:{tmp_path / 'p.json'}",
                 "--capacity", "1,3", "--global", "--order", "token", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [(r["policy"].split(":")[0], r["capacity"], r["scope"]) for r in results] == [
        ("lru", 1, "global"), ("lru", 3, "global"), ("belady", 1, "global"), ("belady", 3, "global"),
        ("learned", 1, "global"), ("learned", 3, "global")]
    assert all(r["requests"] == 48 for r in results)
    assert main(["stats", str(trace), "--json", "--plots", str(tmp_path / "plots")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["n_tokens"] == 12 and doc["k"] == 2 and len(doc["gini"]) == 2
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["hit_rate.png", "popularity.png",
                                                                       "reuse_distance.png"]
    assert (tmp_path / "plots" / "hit_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", str(tmp_path / "missing.npz")]) == 2


@needs_mixtral
@pytest.mark.parametrize("scored, learned_on", [("humaneval", "gsm8k"), ("gsm8k", "humaneval")])
def test_learned_policy_beats_lru_above_k_on_the_other_mixtral_trace(tmp_path, scored, learned_on):
    score = import_trace(MIXTRAL / f"{scored}.jsonl")
    build_profile(import_trace(MIXTRAL / f"{learned_on}.jsonl"), 0, True).save(tmp_path / "p.json")
    capacities = [3, 4, 5, 6]  # above k = 2
    results = {(r.policy.split(":")[0], r.capacity): r.hit_rate for r in simulate_grid(
        score, ["lru", f"learned:{tmp_path / 'p.json'}", "belady"], capacities, "per-layer")}
    for c in capacities:
        assert results["lru", c] < results["learned", c] < results["belady", c], c


def test_halves_split_by_prompt_or_by_token():
    t = two_layer_trace()  # one prompt of 4 tokens
    first, second = halves(t)
    assert first.expert_ids.tolist() == t.expert_ids[:2].tolist()
    assert second.expert_ids.tolist() == t.expert_ids[2:].tolist()
    three = RoutingTrace(model="m", arch="x", layers=[0], n_experts=2, k=1, prompt_offsets=[0, 1, 3, 4],
                         expert_ids=[[[0]], [[1]], [[1]], [[0]]], weights=np.ones((4, 1, 1)))
    first, second = halves(three)
    assert first.prompt_offsets.tolist() == [0, 1] and second.prompt_offsets.tolist() == [0, 2, 3]


def test_window_is_chosen_from_the_profiled_trace_alone():
    # a 3-expert cycle with a fourth expert every 20 tokens; windows differ in how well they predict
    rows = [[[3]] if t % 20 == 0 else [[t % 3]] for t in range(400)]
    t = RoutingTrace(model="m", arch="x", layers=[0], n_experts=5, k=1, prompt_offsets=[0, 200, 400],
                     expert_ids=rows, weights=np.ones((400, 1, 1)))
    first, second = halves(t)
    hits = {}
    for window in WINDOW_CHOICES:  # learn on one half, replay on the other, both ways, capacities 2..4
        hits[window] = 0
        for learn_on, score_on in ((first, second), (second, first)):
            table = learn_reuse_table(learn_on, window)
            for capacity in (2, 3, 4):
                policy = LearnedReuse(capacity, table, k=1)
                hits[window] += sum(policy.access(e).hit for e in score_on.expert_ids[:, 0, 0].tolist())
    assert len(set(hits.values())) > 1
    best = max(WINDOW_CHOICES, key=hits.__getitem__)
    assert choose_window(t) == best
    assert build_profile(t, 0, per_layer=True).reuse.window == best


@pytest.mark.parametrize("scored", [0, 1])
def test_learned_policy_beats_lru_above_k_on_the_built_in_models_other_prompts(tmp_path, scored):
    """The built-in model on text it never trained on (tests/data/stdlib-moe-docs): learned on
    every other prompt, scored on the rest, between LRU and Belady at every capacity above k."""
    trace = RoutingTrace.load(STDLIB_DOCS)
    score = trace.select_prompts(list(range(scored, trace.n_prompts, 2)))
    learned_on = trace.select_prompts(list(range(1 - scored, trace.n_prompts, 2)))
    build_profile(learned_on, 0, True).save(tmp_path / "p.json")
    capacities = [3, 4, 6, 8, 12]  # above k = 2, of 16
    results = {(r.policy.split(":")[0], r.capacity): r.hit_rate for r in simulate_grid(
        score, ["lru", f"learned:{tmp_path / 'p.json'}", "belady"], capacities, "per-layer")}
    for c in capacities:
        assert results["lru", c] < results["learned", c] < results["belady", c], c
