"""Routing statistics: hand-worked values, and the Mixtral paper's reuse pattern on the real trace."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from real_traces import MIXTRAL, STDLIB_DOCS, needs_mixtral

from moeswap.routing import stats
from moeswap.routing.importers import import_trace
from moeswap.routing.traces import RoutingTrace



def hand_trace() -> RoutingTrace:
    # 2 layers, 4 experts, top-2; prompt 0 = tokens 0-2, prompt 1 = tokens 3-4; token 2 unrecorded at layer 1
    ids = [
        [[0, 1], [2, 3]],
        [[0, 2], [3, 2]],
        [[1, 0], [-1, -1]],
        [[1, 3], [0, 1]],
        [[2, 3], [0, 2]],
    ]
    return RoutingTrace(model="hand", arch="x", layers=[0, 1], n_experts=4, k=2, prompt_offsets=[0, 3, 5],
                        expert_ids=ids, weights=np.full((5, 2, 2), 0.5))


def test_popularity_gini_entropy_top_share():
    t = hand_trace()
    counts = stats.popularity(t)
    assert counts.tolist() == [[3, 3, 2, 2], [2, 1, 3, 2]]
    assert stats.gini(np.array([5, 5, 5, 5])) == pytest.approx(0.0)
    assert stats.gini(np.array([0, 0, 0, 8])) == pytest.approx(0.75)
    assert stats.gini(np.array([1, 3])) == pytest.approx(0.25)  # mean abs diff 1 / (2 * mean 2)
    assert stats.entropy_bits(np.array([1, 1, 1, 1])) == pytest.approx(2.0)
    assert stats.entropy_bits(np.array([2, 0, 0, 2])) == pytest.approx(1.0)
    assert stats.top_share(counts).tolist() == pytest.approx([3 / 10, 3 / 8])  # ceil(0.4) = 1 expert


def test_consecutive_reuse_respects_prompts_and_gaps():
    first, any_ = stats.consecutive_reuse(hand_trace())
    # layer 0 pairs (0,1), (1,2), (3,4): first same 1 of 3 (0,0); overlap: {0,1}&{0,2} yes, {0,2}&{1,0} yes, {1,3}&{2,3} yes
    assert first[0] == pytest.approx(1 / 3) and any_[0] == pytest.approx(1.0)
    # layer 1 pairs (0,1), (3,4): first 0/2; overlap {2,3}&{3,2} yes, {0,1}&{0,2} yes; first (3,4): 0 == 0 -> 1/2
    assert first[1] == pytest.approx(1 / 2) and any_[1] == pytest.approx(1.0)
    assert stats.random_reuse(8, 2) == pytest.approx((0.125, 1 - 6 / 8 * 5 / 7))


def test_reuse_distances_count_tokens_within_a_layer():
    # layer 0: expert 0 at tokens 0,1,2 -> 1,1; expert 1 at 0,2,3 -> 2,1; expert 2 at 1,4 -> 3; expert 3 at 3,4 -> 1
    # layer 1 (recorded tokens 0,1,3,4 -> positions 0..3): 2:{0,1,3} -> 1,2; 3:{0,1} -> 1; 0:{2,3} -> 1
    assert stats.reuse_distances(hand_trace()).tolist() == [0, 7, 2, 1]


def test_coactivation_and_next_layer_guess():
    t = hand_trace()
    co = stats.coactivation(t)
    assert co.shape == (1, 4, 4) and co.sum() == 4 * 4  # 4 tokens recorded at both layers, 2x2 pairs each
    assert co[0, 0, 2] == 2 and co[0, 0, 3] == 2 and co[0, 1, 0] == 1
    conditional, popular = stats.next_layer_predictability(t, co, stats.popularity(t))
    assert 0 <= popular[0] <= conditional[0] <= 1


def test_the_table_fits_80_columns_uncut():
    from rich.console import Console

    console = Console(width=80, record=True)
    stats.render_stats(stats.trace_stats(hand_trace()), console)
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80
    assert "…" not in text  # no header or cell cut short
    for word in ("entropy", "top-10%", "any-of-2", "popular", "next MI", "(bits)"):
        assert word in text


def test_mutual_information_between_layers():
    independent = np.ones((1, 2, 2))  # every pair equally often
    determined = np.array([[[5, 0], [0, 5]]])  # expert at l fixes expert at l+1
    assert stats.mutual_information_bits(independent).tolist() == pytest.approx([0.0])
    assert stats.mutual_information_bits(determined).tolist() == pytest.approx([1.0])


def independent_reuse(path: Path) -> dict[int, tuple[float, float]]:
    """Per layer (first-choice share, any-overlap share) straight from the JSONL rows."""
    by_run = defaultdict(dict)
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            by_run[row["problem_id"], row["layer"]][row["token_idx"]] = row["experts"]
    same_first, overlap, pairs = defaultdict(int), defaultdict(int), defaultdict(int)
    for (_, layer), tokens in by_run.items():
        for i in tokens:
            if i + 1 in tokens:
                a, b = tokens[i], tokens[i + 1]
                pairs[layer] += 1
                same_first[layer] += a[0] == b[0]
                overlap[layer] += bool(set(a) & set(b))
    return {layer: (same_first[layer] / pairs[layer], overlap[layer] / pairs[layer]) for layer in pairs}


@needs_mixtral
@pytest.mark.parametrize("name", ["gsm8k", "humaneval"])
def test_mixtral_reuse_matches_independent_count_and_the_papers_pattern(name):
    path = MIXTRAL / f"{name}.jsonl"
    first, any_ = stats.consecutive_reuse(import_trace(path))
    expected = independent_reuse(path)
    assert first.tolist() == pytest.approx([expected[layer][0] for layer in range(32)], abs=1e-12)
    assert any_.tolist() == pytest.approx([expected[layer][1] for layer in range(32)], abs=1e-12)
    # the paper (Table 5): layer 0 near random (12.5 % / 46 %), middle layers clearly above it
    random_first, random_any = stats.random_reuse(8, 2)
    assert abs(first[0] - random_first) < 0.03 and abs(any_[0] - random_any) < 0.07
    middle = slice(8, 24)
    assert first[middle].mean() > random_first + 0.06 and first[middle].mean() > first[0] + 0.05
    assert any_[middle].mean() > random_any + 0.08 and any_[middle].mean() > any_[0] + 0.05


def test_built_in_model_reuse_matches_independent_count_and_beats_random():
    """Consecutive-token reuse on the built-in model's trace (tests/data/stdlib-moe-docs),
    counted again here from the raw ids, prompt by prompt; every layer above random routing."""
    trace = RoutingTrace.load(STDLIB_DOCS)
    first, any_ = stats.consecutive_reuse(trace)
    ids = trace.expert_ids  # [T, L, k]
    pairs = [t for p in range(trace.n_prompts)
             for t in range(trace.prompt_offsets[p], trace.prompt_offsets[p + 1] - 1)]
    for layer in range(trace.n_layers):
        same = [ids[t, layer, 0] == ids[t + 1, layer, 0] for t in pairs]
        shared = [bool(set(ids[t, layer]) & set(ids[t + 1, layer])) for t in pairs]
        assert first[layer] == pytest.approx(np.mean(same), abs=1e-12)
        assert any_[layer] == pytest.approx(np.mean(shared), abs=1e-12)
    random_first, random_any = stats.random_reuse(16, 2)
    assert (first > random_first + 0.05).all() and (any_ > random_any + 0.1).all()
