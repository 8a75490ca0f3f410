"""moeswap plan: byte counts against hand arithmetic on generated GGUFs, KV sizes against the
engines' real caches, moeswap's placement and refusals, rates and fixed costs; and the helpers
test_planner_replay.py (hit rates from a trace) and test_planner_engines.py (llama.cpp, Ollama,
vLLM, SGLang) import."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import tiny_models
from gguf_builders import gemma4, mixtral

from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.planner import probe
from moeswap.experts.cost import Rates
from moeswap.routing.policies import ReuseTable
from moeswap.planner.probe import Overheads
from moeswap.formats.gguf_file import GGUFFile
from moeswap.gguf_tools.convert import convert
from moeswap.memory import format_size, forward_working_bytes, kv_cache_bytes
from moeswap.planner import rates as planner_rates
from moeswap.planner.placement import Budget, make_plan
from moeswap.planner.rates import DEFAULT_OVERHEADS, PlanRates, plan_rates
from moeswap.planner.sizes import model_sizes
from moeswap.routing.profile import Profile

SHIPPED = Path(__file__).parent.parent / "moeswap" / "data" / "stdlib-moe-q8_0.gguf"
RATES = PlanRates(Rates(disk_read=1e9, link=1e10, host_compute=1e10, device_compute=1e11), "test")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def sizes_of(path):
    gf = GGUFFile.open(path)
    try:
        return model_sizes(gf)
    finally:
        gf.close()


@pytest.fixture(scope="module")
def f32_mixtral(tmp_path_factory):
    """gguf_builders' Mixtral, F32 (the byte counts here are written out by hand); not the
    converted Q8_0 one of conftest's mixtral_file."""
    return mixtral().write(tmp_path_factory.mktemp("mixtral") / "mixtral.gguf")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> a q8_0 GGUF converted from the tiny transformers model."""
    files = {}
    for family in ("deepseek2", "gemma4"):
        folder = tmp_path_factory.mktemp(family)
        tiny_models.save(family, folder / "hf")
        files[family] = convert(folder / "hf", folder / "model.gguf", "q8_0")
    return files


# --- arithmetic ------------------------------------------------------------------------------

def test_mixtral_byte_counts_by_hand(f32_mixtral):
    """F32, D=64, F=32, E=4 top-2, 2 layers, V=32, 4 heads / 2 kv heads of 16."""
    s = sizes_of(f32_mixtral)
    attention = 4 * (64 + 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64)  # attn_norm, q, k, v, output
    per_layer = attention + 4 * (64 + 64 * 4)  # + ffn_norm, router {D, E}
    expert = 4 * (64 * 32 * 3)  # gate, up, down of one expert
    assert s.expert_bytes_by_layer == {0: expert, 1: expert} and expert == 24576
    assert s.layer_bytes == {0: per_layer, 1: per_layer} and per_layer == 50688
    assert s.routed_bytes == 2 * 4 * expert
    assert s.total_bytes == 2 * per_layer + s.routed_bytes + 4 * (64 * 32 + 64 + 64 * 32)
    assert s.shared_bytes == 118016
    assert s.one_expert_bytes == 24576
    # a token reads all shared weights but 31 of the 32 embedding rows, and 2 experts per layer
    assert s.active_bytes_per_token == 118016 - 31 * 64 * 4 + 2 * 2 * expert
    assert s.input_bytes == 64 * 32 * 4 and s.output_bytes == 64 * 4 + 64 * 32 * 4
    # three 8 KiB pieces, each at its file offset modulo a 4 KiB disk block (cold reads land
    # straight in the slot: moeswap.experts.tiers.piece_offsets), in whole blocks
    assert s.slot_bytes % 4096 == 0 and expert <= s.slot_bytes < expert + 4 * 4096
    # layers x (k, v) x kv heads x head size
    assert s.config.kv_floats_per_token_by_kind == (2 * 2 * 2 * 16, 0)
    assert s.kv_bytes(100, 2) == 128 * 2 * 100
    assert kv_cache_bytes(s.config, 100) == 128 * 4 * 100
    assert s.shared_bits_per_weight == 32.0


def test_mla_cache_is_the_latent_and_matches_the_engine(converted):
    """DeepSeek-V2 tiny: 3 layers, kv_lora_rank 32 + 8 rope dims cached per layer."""
    s = sizes_of(converted["deepseek2"])
    assert s.config.kv_floats_per_token_by_kind == (3 * (32 + 8), 0)
    assert s.kv_bytes(1000, 2) == 2 * 120 * 1000
    assert s.moe_layers == [1, 2]  # first_k_dense_replace=1
    import moeswap

    runtime = moeswap.load(converted["deepseek2"])
    cache = runtime.model.new_cache()
    runtime.model.forward([torch.arange(7)], [cache])
    assert cache.n_floats() == 7 * sum(s.config.kv_floats_per_token_by_kind)


def test_sliding_layers_keep_the_window(converted):
    """Gemma 4 tiny: sliding layers 0, 2 (2 kv heads of 16), global 1, 3 (1 kv head of 32),
    window 4."""
    s = sizes_of(converted["gemma4"])
    assert s.config.kv_floats_per_token_by_kind == (2 * 2 * 1 * 32, 2 * 2 * 2 * 16)
    assert s.kv_bytes(10, 2) == 2 * (128 * 10 + 128 * 4)
    assert s.kv_bytes(3, 2) == 2 * 256 * 3
    import moeswap

    runtime = moeswap.load(converted["gemma4"])
    cache = runtime.model.new_cache()
    runtime.model.forward([torch.arange(4)], [cache])  # within the window: every position held
    assert cache.n_floats() == 4 * sum(s.config.kv_floats_per_token_by_kind)


def test_fused_and_scaled_experts_counted(tmp_path):
    s = sizes_of(gemma4().write(tmp_path / "g4.gguf"))
    q8 = 34 / 32  # Q8_0: 34 bytes per 32 values
    gate_up, down = 64 * 64 * q8, 32 * 64 * q8
    assert s.expert_bytes_by_layer == {0: int(gate_up + down + 4), 1: int(gate_up + down + 4)}


# --- moeswap's placement and refusals --------------------------------------------------------

def _need(s, context):
    return (s.shared_bytes + kv_cache_bytes(s.config, context)
            + forward_working_bytes(s.config, 512, context, 1)
            + 2 * s.slot_bytes)


def _profile(counts, hot=None, layers=None):
    layers = layers or list(range(len(counts)))
    hot = hot or [(i, max(range(len(c)), key=c.__getitem__)) for i, c in enumerate(counts)]
    return Profile(model="m", arch="llama", layers=layers, n_experts=len(counts[0]), k=2,
                   budget=len(hot), hot=hot, counts=counts,
                   reuse=ReuseTable((1,), 1, ((0.0, 0.0),)), source="test")


def test_placement_slots_and_uniform_hit_rate(f32_mixtral):
    s = sizes_of(f32_mixtral)
    plan = make_plan(s, Budget(s.slot_bytes, _need(s, 64) + 3 * s.slot_bytes, 64), RATES)
    assert (plan.device_slots, plan.host_slots) == (1, 3)
    assert plan.resident_by_layer == {0: 2, 1: 2}
    assert plan.hits.device == pytest.approx(1 / 8) and plan.hits.total == pytest.approx(4 / 8)
    assert plan.disk_expert_bytes == 4 * s.one_expert_bytes
    # a forward of 64 tokens: 4 bytes x (2 x 4 heads x 64 + 16 x 64 width) per token, and one
    # logits row of 2 x 32 vocabulary
    assert plan.working_bytes == 4 * (64 * (2 * 4 * 64 + 16 * 64) + 2 * 32)
    assert plan.host_charged == 118016 + 512 * 64 + plan.working_bytes + 2 * s.slot_bytes


def test_fewer_slots_than_a_tokens_requests_thrash(f32_mixtral):
    s = sizes_of(f32_mixtral)  # top-2 of 2 layers: 4 requests per token
    plan = make_plan(s, Budget(0, _need(s, 64) + 3 * s.slot_bytes, 64), RATES)
    assert plan.host_slots == 3 and plan.hits.total == 0.0 and "no hits" in plan.hits.source


def test_profile_hit_rate_is_its_top_experts_share(f32_mixtral):
    s = sizes_of(f32_mixtral)
    profile = _profile(counts=[[50, 30, 15, 5], [70, 10, 10, 10]])
    plan = make_plan(s, Budget(0, _need(s, 8) + 3 * s.slot_bytes, 8), RATES, profile)
    # the three most used of all eight: layer 1 expert 0 (70), layer 0 experts 0 (50), 1 (30)
    assert plan.hits.total == pytest.approx(150 / 200)
    assert plan.resident_by_layer == {0: 2, 1: 1}


def test_refusal_says_by_how_much_and_what_to_change(f32_mixtral):
    s = sizes_of(f32_mixtral)
    need = _need(s, 100)
    with pytest.raises(MoeswapError) as e:
        make_plan(s, Budget(0, need - 512 * 10, 100), RATES)
    message = str(e.value)
    assert "is 5.00 KiB short" in message
    assert f"--host-mem {format_size(need)} or more" in message
    ctx = int(re.search(r"--ctx (\d+) fits", message).group(1))
    # at least 10 positions of 512 bytes fewer; the largest context that fits, exactly
    assert 90 <= ctx < 100 and _need(s, ctx) <= need - 512 * 10 < _need(s, ctx + 1)
    assert "in Q4_K_M they would be about" in message  # F32 shared weights: 32 bits per weight


def test_cli_refusal_exit_code_and_json(f32_mixtral, capsys):
    assert main(["plan", str(f32_mixtral), "--host-mem", "100KiB", "--ctx", "100"]) == 2
    assert "does not fit" in capsys.readouterr().err
    # 2 MiB: a 100-token step's working memory (738 KiB) and every expert fit
    assert main(["plan", str(f32_mixtral), "--host-mem", "2MiB", "--ctx", "100", "--json",
                 "--disk-bw", "1", "--ram-bw", "10", "--gpu-bw", "100", "--link-bw", "10"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bytes"]["shared"] == 118016 and doc["kv_cache"]["context_bytes_f16"] == 25600
    assert doc["moeswap"]["experts_resident"] == 8 and doc["moeswap"]["hit_rate"]["total"] == 1.0
    assert doc["moeswap"]["rates"]["disk_read"] == 1e9
    assert main(["plan", str(f32_mixtral), "--host-mem", "1MiB", "--ctx", "100"]) == 0
    assert "llama-server" in capsys.readouterr().out


def test_rates_from_flags_over_defaults(tmp_path):
    rates = plan_rates({"disk_read": 2e9, "link": None}, cache=tmp_path / "none.json")
    assert rates.rates.disk_read == 2e9 and "conservative defaults" in rates.source
    assert rates.overheads == DEFAULT_OVERHEADS
    assert "read latency and step costs: conservative defaults" in rates.source


# --- fixed costs: cold-read latency and product calls ------------------------------------------

LADDER = Overheads(read_seconds=((4096, 1e-4), (65536, 3e-4)), layer_step=4e-4, expert_call=5e-5)


def test_read_seconds_between_and_beyond_the_probes_sizes():
    rates = PlanRates(RATES.rates, "test", LADDER)  # disk_read 1 GB/s
    assert rates.read_seconds(1000) == 1e-4  # below the smallest size: its time
    assert rates.read_seconds(4096) == 1e-4
    assert rates.read_seconds(34816) == pytest.approx(2e-4)  # halfway from 4 KiB to 64 KiB
    assert rates.read_seconds(65536 + 10**6) == pytest.approx(3e-4 + 1e-3)  # + 1 MB at 1 GB/s
    # the defaults: a 0.2 ms latency, then the bytes at disk_read
    assert PlanRates(RATES.rates, "test").read_seconds(10**6) == pytest.approx(0.2e-3 + 1e-3)


def test_decode_step_by_hand_with_every_expert_missing(f32_mixtral):
    """No expert slots: each token's 2 experts per layer are read, 3 pieces of 8 KiB each."""
    s = sizes_of(f32_mixtral)
    assert s.expert_pieces_by_layer == {0: (8192,) * 3, 1: (8192,) * 3}
    rates = PlanRates(RATES.rates, "test", LADDER)  # RAM 1e10 B/s
    plan = make_plan(s, Budget(0, _need(s, 64), 64), rates)
    assert plan.host_slots == 0 and plan.hits.total == 0.0
    shared = (118016 - 31 * 64 * 4) / 1e10  # every shared byte but 31 embedding rows
    blocks = 2 * 4e-4
    read_piece = 1e-4 + 2e-4 * (8192 - 4096) / (65536 - 4096)
    per_expert = 24576 / 1e10 + 3 * read_piece + 5e-5  # compute, 3 cold reads, serving it
    experts = 2 * 2 * per_expert  # 2 layers x 2 distinct experts of one token
    cache = 128 * 4 * 64 / 1e10  # float32 K and V of 64 positions
    assert plan.decode_tokens_per_second == pytest.approx(1 / (shared + blocks + experts + cache))


def test_probe_cache_overheads_measured_when_absent_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(probe.platform, "node", lambda: "box")
    monkeypatch.setattr(planner_rates.platform, "node", lambda: "box")
    measured = []

    def measure(threads, folder, host_compute, on_step):
        measured.append(host_compute)
        return LADDER

    monkeypatch.setattr(probe, "measure_overheads", measure)
    old = {"disk_read": 2e9, "link": 3e9, "host_compute": 4e9, "device_compute": 4e9}
    cache = tmp_path / "probe.json"
    cache.write_text(json.dumps({"box threads=1": old, "box threads=all": old}))
    assert probe.read_overheads(cache) == {}  # written before the overheads were measured
    assert plan_rates({}, cache).overheads == DEFAULT_OVERHEADS
    assert probe.cached_overheads(1, cache) == LADDER and measured == [4e9]
    assert probe.cached_overheads(1, cache) == LADDER and measured == [4e9]  # cached
    assert probe.read_cache(cache)["box", "1"] == Rates(**old)  # the rates kept
    assert probe.read_overheads(cache) == {("box", "1"): LADDER}
    entry = json.loads(cache.read_text())["box threads=1"]
    assert entry["read_seconds"] == [[4096, 1e-4], [65536, 3e-4]] and entry["layer_step"] == 4e-4
    one = plan_rates({}, cache, threads="1")
    assert one.overheads == LADDER and one.rates == Rates(**old)
    assert "read latency and step costs: moeswap probe" in one.source
    assert plan_rates({}, cache).overheads == LADDER  # the all-threads entry has none: any other


def test_probe_cache_with_bad_overheads_is_damaged(tmp_path):
    rates = {"disk_read": 2e9, "link": 3e9, "host_compute": 4e9, "device_compute": 4e9}
    cache = tmp_path / "probe.json"
    cache.write_text(json.dumps({"box threads=1": {**rates, "read_seconds": [[4096, -1]],
                                                   "layer_step": 4e-4, "expert_call": 5e-5}}))
    with pytest.raises(MoeswapError, match="overheads that are not positive numbers"):
        probe.read_overheads(cache)


def test_step_costs_measured_on_the_synthetic_model(tmp_path, monkeypatch):
    from moeswap.planner import step_costs

    step_costs.write_model(tmp_path / "synthetic.gguf")
    s = sizes_of(tmp_path / "synthetic.gguf")
    assert (s.config.n_layer, s.n_expert, s.top_k, s.moe_layers) == (4, 8, 2, [0, 1, 2, 3])
    assert s.expert_pieces_by_layer[0] == (256 * 512 * 34 // 32,) * 3  # Q8_0 gate, up, down
    monkeypatch.setattr(step_costs, "ROUNDS", 1)
    monkeypatch.setattr(step_costs, "DECODE_STEPS", 4)
    layer_step, expert_call = step_costs.measure_step_costs(1e10, 1, tmp_path)
    assert 0 < layer_step < 0.1 and 0 < expert_call < 0.1
