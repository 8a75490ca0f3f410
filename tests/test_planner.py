"""moeswap plan: byte counts against hand arithmetic on generated GGUFs, KV sizes against the
engines' real caches, refusals, and llama.cpp overrides against the files' real tensor names."""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path

import numpy as np
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
from moeswap.planner import plan_model, report
from moeswap.planner.distributed import plan_multi_gpu
from moeswap.planner.llama_cpp import EXPERT_PATTERN, GPU_RESERVE, plan_llama_cpp
from moeswap.planner import rates as planner_rates
from moeswap.planner.placement import Budget, make_plan
from moeswap.planner.rates import DEFAULT_OVERHEADS, PlanRates, plan_rates
from moeswap.planner.replayed import lru_hit_rate
from moeswap.planner.sizes import model_sizes
from moeswap.routing.profile import Profile
from moeswap.routing.traces import RoutingTrace

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
def mixtral_file(tmp_path_factory):
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

def test_mixtral_byte_counts_by_hand(mixtral_file):
    """F32, D=64, F=32, E=4 top-2, 2 layers, V=32, 4 heads / 2 kv heads of 16."""
    s = sizes_of(mixtral_file)
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


def test_placement_slots_and_uniform_hit_rate(mixtral_file):
    s = sizes_of(mixtral_file)
    plan = make_plan(s, Budget(s.slot_bytes, _need(s, 64) + 3 * s.slot_bytes, 64), RATES)
    assert (plan.device_slots, plan.host_slots) == (1, 3)
    assert plan.resident_by_layer == {0: 2, 1: 2}
    assert plan.hits.device == pytest.approx(1 / 8) and plan.hits.total == pytest.approx(4 / 8)
    assert plan.disk_expert_bytes == 4 * s.one_expert_bytes
    # a forward of 64 tokens: 4 bytes x (2 x 4 heads x 64 + 16 x 64 width) per token, and one
    # logits row of 2 x 32 vocabulary
    assert plan.working_bytes == 4 * (64 * (2 * 4 * 64 + 16 * 64) + 2 * 32)
    assert plan.host_charged == 118016 + 512 * 64 + plan.working_bytes + 2 * s.slot_bytes


def test_fewer_slots_than_a_tokens_requests_thrash(mixtral_file):
    s = sizes_of(mixtral_file)  # top-2 of 2 layers: 4 requests per token
    plan = make_plan(s, Budget(0, _need(s, 64) + 3 * s.slot_bytes, 64), RATES)
    assert plan.host_slots == 3 and plan.hits.total == 0.0 and "no hits" in plan.hits.source


def test_profile_hit_rate_is_its_top_experts_share(mixtral_file):
    s = sizes_of(mixtral_file)
    profile = _profile(counts=[[50, 30, 15, 5], [70, 10, 10, 10]])
    plan = make_plan(s, Budget(0, _need(s, 8) + 3 * s.slot_bytes, 8), RATES, profile)
    # the three most used of all eight: layer 1 expert 0 (70), layer 0 experts 0 (50), 1 (30)
    assert plan.hits.total == pytest.approx(150 / 200)
    assert plan.resident_by_layer == {0: 2, 1: 1}


def test_refusal_says_by_how_much_and_what_to_change(mixtral_file):
    s = sizes_of(mixtral_file)
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


def test_cli_refusal_exit_code_and_json(mixtral_file, capsys):
    assert main(["plan", str(mixtral_file), "--host-mem", "100KiB", "--ctx", "100"]) == 2
    assert "does not fit" in capsys.readouterr().err
    # 2 MiB: a 100-token step's working memory (738 KiB) and every expert fit
    assert main(["plan", str(mixtral_file), "--host-mem", "2MiB", "--ctx", "100", "--json",
                 "--disk-bw", "1", "--ram-bw", "10", "--gpu-bw", "100", "--link-bw", "10"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bytes"]["shared"] == 118016 and doc["kv_cache"]["context_bytes_f16"] == 25600
    assert doc["moeswap"]["experts_resident"] == 8 and doc["moeswap"]["hit_rate"]["total"] == 1.0
    assert doc["moeswap"]["rates"]["disk_read"] == 1e9
    assert main(["plan", str(mixtral_file), "--host-mem", "1MiB", "--ctx", "100"]) == 0
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


def test_decode_step_by_hand_with_every_expert_missing(mixtral_file):
    """No expert slots: each token's 2 experts per layer are read, 3 pieces of 8 KiB each."""
    s = sizes_of(mixtral_file)
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


def test_plan_with_a_trace_and_the_cli(mixtral_file, tmp_path, capsys):
    s = sizes_of(mixtral_file)
    plan = make_plan(s, Budget(s.slot_bytes, _need(s, 8) + 3 * s.slot_bytes, 8), RATES,
                     trace=_trace())
    assert plan.hits.total == pytest.approx(0.5)
    assert plan.hits.device == pytest.approx(0.5 / 4)  # 1 of the 4 slots
    assert "LRU replayed over its 12 decode requests" in plan.hits.source
    with pytest.raises(MoeswapError, match="traced layers .* with 5 experts"):
        make_plan(s, Budget(0, _need(s, 8), 8), RATES, trace=_trace(n_experts=5))
    path = tmp_path / "t.npz"
    _trace().save(path)
    assert main(["plan", str(mixtral_file), "--host-mem", str(_need(s, 8) + 4 * s.slot_bytes),
                 "--ctx", "8", "--profile", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["moeswap"]["hit_rate"]["total"] == 0.5
    assert "--policy" not in doc["moeswap"]["command"]  # the default LRU is what was replayed


# --- llama.cpp, Ollama, vLLM, SGLang -------------------------------------------------------------

def _profile(counts, hot=None, layers=None):
    layers = layers or list(range(len(counts)))
    hot = hot or [(i, max(range(len(c)), key=c.__getitem__)) for i, c in enumerate(counts)]
    return Profile(model="m", arch="llama", layers=layers, n_experts=len(counts[0]), k=2,
                   budget=len(hot), hot=hot, counts=counts,
                   reuse=ReuseTable((1,), 1, ((0.0, 0.0),)), source="test")


def _cpu_tensors(names, args):
    """The tensors llama.cpp puts on the CPU for these flags, by its own rule: -ot patterns and
    the --cpu-moe / --n-cpu-moe expansions, each matched with regex_search."""
    patterns = []
    if "--cpu-moe" in args:
        patterns.append(EXPERT_PATTERN)
    if "--n-cpu-moe" in args:
        n = int(args[args.index("--n-cpu-moe") + 1])
        patterns += [rf"blk\.{i}{EXPERT_PATTERN}" for i in range(n)]
    if "-ot" in args:
        patterns.append(args[args.index("-ot") + 1].rsplit("=", 1)[0])
    return {n for n in names if any(re.search(p, n) for p in patterns)}


def _experts_of(names, layers):
    return {n for n in names for i in layers
            if n.startswith(f"blk.{i}.") and "_exps." in n}


def test_llama_cpp_n_cpu_moe_keeps_the_last_layers_on_the_gpu():
    s = sizes_of(SHIPPED)  # the project's trained model: 6 layers, Q8_0
    blocks = sum(s.layer_bytes.values()) + s.output_bytes + s.kv_bytes(512, 2)
    three = 3 * s.n_expert * s.one_expert_bytes
    plan = plan_llama_cpp(s, Budget(GPU_RESERVE + blocks + three, 1 * GiB, 512), RATES)
    assert plan.args[plan.args.index("-ngl") + 1] == "7"  # 6 blocks + the output head
    assert plan.args[plan.args.index("--n-cpu-moe") + 1] == "3"
    assert plan.cpu_expert_layers == [0, 1, 2] and "--mlock" in plan.args
    names = s.tensor_names
    assert _cpu_tensors(names, plan.args) == _experts_of(names, [0, 1, 2])
    assert plan.gpu_bytes == blocks + three


def test_llama_cpp_profile_regex_selects_exactly_the_cpu_layers_experts():
    s = sizes_of(SHIPPED)
    counts = [[10] * 16 for _ in range(6)]
    for layer, top in ((0, 80), (1, 20), (2, 90), (3, 15), (4, 60), (5, 85)):
        counts[layer][3] = top  # the layers whose one hot expert covers least spread widest
    profile = _profile(counts, hot=[(i, 3) for i in range(6)])
    assert s.n_expert == 16
    blocks = sum(s.layer_bytes.values()) + s.output_bytes + s.kv_bytes(512, 2)
    two = 2 * s.n_expert * s.one_expert_bytes
    plan = plan_llama_cpp(s, Budget(GPU_RESERVE + blocks + two, 1 * GiB, 512), RATES, profile)
    assert plan.cpu_expert_layers == [0, 2, 4, 5]  # layers 3 and 1 spread widest: on the GPU
    assert plan.override == r"blk\.(0|2|4|5)\.ffn_(up|down|gate|gate_up)_(ch|)exps"
    names = s.tensor_names
    assert _cpu_tensors(names, plan.args) == _experts_of(names, [0, 2, 4, 5])
    assert not any(re.search(plan.override, n) for n in names if "blk.1." in n or "blk.3." in n)


def test_llama_cpp_small_gpu_keeps_attention_of_the_last_blocks(converted):
    s = sizes_of(converted["gemma4"])
    per_block = max(s.layer_bytes.values()) + s.kv_bytes(64, 2) / 4
    plan = plan_llama_cpp(s, Budget(GPU_RESERVE + int(2.5 * per_block), 64 * MiB, 64), RATES)
    assert plan.args[plan.args.index("-ngl") + 1] == "2" and "--cpu-moe" in plan.args
    names = s.tensor_names
    assert _cpu_tensors(names, plan.args) == _experts_of(names, range(4))
    assert any("ffn_gate_up_exps" in n for n in _cpu_tensors(names, plan.args))
    assert not any("ffn_gate_inp" in n or n.endswith("ffn_gate.weight")
                   for n in _cpu_tensors(names, plan.args))


def test_no_mlock_when_ram_is_short(mixtral_file):
    s = sizes_of(mixtral_file)
    plan = plan_llama_cpp(s, Budget(0, 100 * KiB, 16), RATES)
    assert "--mlock" not in plan.args and "no --mlock" in plan.notes[-1]


def test_ollama_counts_whole_blocks(mixtral_file):
    full = plan_model(mixtral_file, Budget(GPU_RESERVE + 160 * KiB, MiB, 100), RATES)
    text, layers, notes = full.ollama
    assert layers == 1  # a block with its experts is 50688 + 98304 bytes + 12.5 KiB of cache
    assert text == f"FROM {mixtral_file}\nPARAMETER num_ctx 100\nPARAMETER num_gpu 1\n"
    assert "no per-tensor placement" in notes[0]


def test_multi_gpu_mla_gets_data_parallel_attention(converted):
    s = sizes_of(converted["deepseek2"])
    plan = plan_multi_gpu(s, Budget(0, GiB, 4096, 8), 4, 80 * GiB)
    assert plan.vllm[3:] == ["--tensor-parallel-size", "1", "--data-parallel-size", "4",
                             "--enable-expert-parallel", "--max-model-len", "4096",
                             "--gpu-memory-utilization", "0.9"]
    assert plan.sglang[5:] == ["--tp-size", "4", "--ep-size", "4", "--dp-size", "4",
                               "--enable-dp-attention", "--context-length", "4096",
                               "--mem-fraction-static", "0.9"]
    assert plan.kv_per_gpu == s.kv_bytes(4096, 2, 2) and plan.fits


def test_multi_gpu_gqa_tensor_parallel_and_cpu_offload(mixtral_file):
    s = sizes_of(mixtral_file)
    plan = plan_multi_gpu(s, Budget(0, GiB, 64), 2, 100 * KiB)
    assert plan.vllm[3:5] == ["--tensor-parallel-size", "2"]
    assert "--data-parallel-size" not in plan.vllm and "--enable-dp-attention" not in plan.sglang
    assert plan.weights_per_gpu == s.total_bytes // 2
    assert plan.vllm[-2:] == ["--cpu-offload-gb", "1"] and not plan.fits
    assert plan.gpus_needed == 4


def test_report_is_json(mixtral_file):
    full = plan_model(mixtral_file, Budget(0, MiB, 100), RATES, gpus=2, gpu_bytes=GiB)
    doc = json.loads(json.dumps(report(full)))
    assert doc["multi_gpu"]["fits"] and doc["llama_cpp"]["n_gpu_layers"] == 0


# --- llama.cpp itself ----------------------------------------------------------------------------

_LOG: list[str] = []
_KEEP_ALIVE: list = []  # llama.cpp keeps calling the log callback after the test


@pytest.mark.llama_cpp
def test_llama_cpp_applies_the_planned_overrides_to_exactly_those_tensors():
    """llama_cpp's high-level Llama() takes no tensor overrides, but llama_model_params has
    tensor_buft_overrides: the planner's -ot regex is handed to llama.cpp there, and its log
    names every tensor it moved. Also checks the f16 KV cache size it allocates."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                                    "(CI installs it)")
    s = sizes_of(SHIPPED)
    profile = _profile([[10] * 15 + [l] for l in (5, 50, 5, 50, 50, 5)],
                       hot=[(i, 15) for i in range(6)])
    blocks = sum(s.layer_bytes.values()) + s.output_bytes + s.kv_bytes(4096, 2)
    plan = plan_llama_cpp(s, Budget(GPU_RESERVE + blocks + 3 * 16 * s.one_expert_bytes, GiB, 4096),
                          RATES, profile)
    assert plan.override is not None

    @llama_cpp.llama_log_callback
    def collect(level, text, user):
        _LOG.append(text.decode(errors="replace"))

    class Override(ctypes.Structure):
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    cpu = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    overrides = (Override * 2)()
    overrides[0].pattern = plan.override.encode()
    overrides[0].buft = cpu.ggml_backend_cpu_buffer_type()
    params = llama_cpp.llama_model_default_params()
    params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
    _LOG.clear()
    _KEEP_ALIVE.append(collect)
    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    model = llama_cpp.llama_model_load_from_file(str(SHIPPED).encode(), params)
    assert model
    context_params = llama_cpp.llama_context_default_params()
    context_params.n_ctx = 4096
    context = llama_cpp.llama_init_from_model(model, context_params)
    assert context
    llama_cpp.llama_free(context)
    llama_cpp.llama_model_free(model)
    moved = {m.group(1) for line in _LOG
             for m in [re.match(r"tensor (\S+) .*buffer type overridden to CPU", line)] if m}
    assert moved == _experts_of(s.tensor_names, plan.cpu_expert_layers) and moved
    size = next(line for line in _LOG if "llama_kv_cache: size =" in line)
    k_mib = float(re.search(r"K \(f16\):\s+([\d.]+) MiB", size).group(1))
    assert k_mib == round(s.kv_bytes(4096, 2) / 2 / MiB, 2)


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
