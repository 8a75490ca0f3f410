"""moeswap plan's hit rates from a recorded trace: the store's LRU replayed by hand, per prompt,
through the CLI, and against the hits the store itself counts over real runs of the shipped model."""

# ruff: noqa: F811 (test_planner's fixtures, imported, are the tests' arguments)
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_planner import RATES, SHIPPED, _need, f32_mixtral, sizes_of  # noqa: F401 (fixture)

from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.memory import forward_working_bytes, kv_cache_bytes
from moeswap.planner.placement import Budget, make_plan
from moeswap.planner.replayed import lru_hit_rate
from moeswap.routing.traces import RoutingTrace


# --- hit rates from a recorded trace: the store's LRU replayed ---------------------------------

def _trace(n_experts=4):
    """Mixtral file's shape (layers 0, 1; top-2): 2 prefill tokens, then 3 decoded."""
    ids = [[[0, 1], [2, 3]], [[1, 2], [3, 0]],  # prefill
           [[0, 1], [3, 2]], [[2, 0], [1, 3]], [[0, 1], [2, 3]]]  # decode
    return RoutingTrace(model="m", arch="llama", layers=[0, 1], n_experts=n_experts, k=2,
                        prompt_offsets=[0, 5], expert_ids=ids,
                        weights=[[[0.5, 0.5]] * 2] * 5, phase=np.array([0, 0, 1, 1, 1], np.uint8),
                        source="t.npz")


def test_replayed_lru_counts_the_decode_steps_in_the_stores_order():
    """Prefill is one step per layer: layer 0 asks 0, 1, 2 and layer 1 asks 0, 2, 3 (ascending);
    then each decoded token asks its two experts per layer. By hand, with 4 slots:
    t2: (0,0) miss, (0,1) miss, (1,2) hit, (1,3) hit; t3: (0,0) hit, (0,2) miss, (1,1) miss,
    (1,3) hit; t4: (0,0) hit, (0,1) miss, (1,2) miss, (1,3) hit: 6 of 12.
    With 6 slots only t3's (1,1) misses; with none, nothing hits."""
    assert lru_hit_rate(_trace(), 4) == (6 / 12, 12)
    assert lru_hit_rate(_trace(), 6) == (11 / 12, 12)
    assert lru_hit_rate(_trace(), 0) == (0.0, 12)


def test_replayed_lru_starts_every_prompt_from_an_empty_cache():
    """Each prompt is a run of its own (moeswap run starts its store empty). Prompt 0 decodes
    the same token twice: 4 misses, then 4 hits with 4 slots; prompt 1 decodes it once more:
    4 misses, where one cache kept over both prompts would hit all 4. 4 of 12."""
    token = [[0, 1], [2, 3]]
    trace = RoutingTrace(model="m", arch="llama", layers=[0, 1], n_experts=4, k=2,
                         prompt_offsets=[0, 2, 3], expert_ids=[token] * 3,
                         weights=[[[0.5, 0.5]] * 2] * 3, phase=np.ones(3, np.uint8))
    assert lru_hit_rate(trace, 4) == (4 / 12, 12)
    assert lru_hit_rate(trace, 8) == (4 / 12, 12)


def test_plan_with_a_trace_and_the_cli(f32_mixtral, tmp_path, capsys):
    s = sizes_of(f32_mixtral)
    plan = make_plan(s, Budget(s.slot_bytes, _need(s, 8) + 3 * s.slot_bytes, 8), RATES,
                     trace=_trace())
    assert plan.hits.total == pytest.approx(0.5)
    assert plan.hits.device == pytest.approx(0.5 / 4)  # 1 of the 4 slots
    assert "LRU replayed over its 12 decode requests" in plan.hits.source
    with pytest.raises(MoeswapError, match="traced layers .* with 5 experts"):
        make_plan(s, Budget(0, _need(s, 8), 8), RATES, trace=_trace(n_experts=5))
    path = tmp_path / "t.npz"
    _trace().save(path)
    assert main(["plan", str(f32_mixtral), "--host-mem", str(_need(s, 8) + 4 * s.slot_bytes),
                 "--ctx", "8", "--profile", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["moeswap"]["hit_rate"]["total"] == 0.5
    assert "--policy" not in doc["moeswap"]["command"]  # the default LRU is what was replayed


def test_replayed_lru_matches_the_stores_decode_hits(tmp_path, capsys):
    """The store's own hit count over the decode steps (a run of 9 tokens less a run of 1) equals
    the replay of that run's trace, on the shipped model at a quarter of the slots."""
    prompt = "def parse_args(argv):\n    "
    trace = tmp_path / "run.npz"
    assert main(["run", str(SHIPPED), "-p", prompt, "-n", "9", "--temp", "0",
                 "--trace", str(trace)]) == 0
    s = sizes_of(SHIPPED)
    slots = s.n_expert * len(s.moe_layers) // 4
    step, context = len(prompt.encode()) + 1, len(prompt.encode()) + 10  # as `run` charges
    host = (s.shared_bytes + kv_cache_bytes(s.config, context, 1, step)
            + forward_working_bytes(s.config, step, context, 1)
            + (s.top_k + slots) * s.slot_bytes)

    def store_counts(n_predict):
        capsys.readouterr()
        assert main(["run", str(SHIPPED), "-p", prompt, "-n", str(n_predict), "--temp", "0",
                     "--host-mem", str(host), "--prefetch", "off"]) == 0
        line = re.search(r"experts: (\d+) used, hit rate \S+ \(device 0, host (\d+)\)",
                         capsys.readouterr().err)
        return int(line.group(1)), int(line.group(2))

    (requests_1, hits_1), (requests_9, hits_9) = store_counts(1), store_counts(9)
    rate, requests = lru_hit_rate(RoutingTrace.load(trace), slots)
    assert requests == requests_9 - requests_1 == 8 * s.top_k * len(s.moe_layers)
    assert rate * requests == pytest.approx(hits_9 - hits_1)


def test_replayed_prompts_of_moeswap_trace_match_the_stores_runs(tmp_path, capsys):
    """A `moeswap trace` of two prompts with -n 8 (8 decoded tokens run) replayed at half the
    slots gives the decode hits the store counts over separate `moeswap run -n 9`s of them
    (each less its -n 1 run), summed: each prompt replayed from an empty cache, as a run is.
    The prompts are short, so a cache kept from the first prompt would still hold experts in
    the second one's decode (130 hits of 192 instead of the runs' 119)."""
    prompts = ["def", "import"]
    trace = tmp_path / "two.npz"
    assert main(["trace", str(SHIPPED), "-p", prompts[0], "-p", prompts[1], "-n", "8",
                 "-o", str(trace), "--threads", "1"]) == 0
    s = sizes_of(SHIPPED)
    slots = s.n_expert * len(s.moe_layers) // 2
    hits = requests = 0
    for prompt in prompts:
        step, context = len(prompt.encode()) + 1, len(prompt.encode()) + 10  # as `run` charges
        host = (s.shared_bytes + kv_cache_bytes(s.config, context, 1, step)
                + forward_working_bytes(s.config, step, context, 1)
            + (s.top_k + slots) * s.slot_bytes)
        counts = []
        for n_predict in (1, 9):
            capsys.readouterr()
            assert main(["run", str(SHIPPED), "-p", prompt, "-n", str(n_predict), "--temp", "0",
                         "--host-mem", str(host), "--prefetch", "off"]) == 0
            line = re.search(r"experts: (\d+) used, hit rate \S+ \(device 0, host (\d+)\)",
                             capsys.readouterr().err)
            counts.append((int(line.group(1)), int(line.group(2))))
        requests += counts[1][0] - counts[0][0]
        hits += counts[1][1] - counts[0][1]
    rate, replayed = lru_hit_rate(RoutingTrace.load(trace), slots)
    assert replayed == requests == 2 * 8 * s.top_k * len(s.moe_layers)
    assert rate * replayed == pytest.approx(hits)
