"""moeswap plan's commands for the other engines: llama.cpp's -ngl, --n-cpu-moe and -ot overrides
against the files' real tensor names (and applied by llama.cpp itself), Ollama's whole blocks,
vLLM's and SGLang's multi-GPU flags, and the JSON report."""

# ruff: noqa: F811 (test_planner's fixtures, imported, are the tests' arguments)
from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path

import pytest
from test_planner import (RATES, SHIPPED, GiB, KiB, MiB, _profile, converted,  # noqa: F401 (fixtures)
                          f32_mixtral, sizes_of)

from moeswap.planner import plan_model, report
from moeswap.planner.distributed import plan_multi_gpu
from moeswap.planner.llama_cpp import EXPERT_PATTERN, GPU_RESERVE, plan_llama_cpp
from moeswap.planner.placement import Budget


# --- llama.cpp, Ollama, vLLM, SGLang -------------------------------------------------------------

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


def test_no_mlock_when_ram_is_short(f32_mixtral):
    s = sizes_of(f32_mixtral)
    plan = plan_llama_cpp(s, Budget(0, 100 * KiB, 16), RATES)
    assert "--mlock" not in plan.args and "no --mlock" in plan.notes[-1]


def test_ollama_counts_whole_blocks(f32_mixtral):
    full = plan_model(f32_mixtral, Budget(GPU_RESERVE + 160 * KiB, MiB, 100), RATES)
    text, layers, notes = full.ollama
    assert layers == 1  # a block with its experts is 50688 + 98304 bytes + 12.5 KiB of cache
    assert text == f"FROM {f32_mixtral}\nPARAMETER num_ctx 100\nPARAMETER num_gpu 1\n"
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


def test_multi_gpu_gqa_tensor_parallel_and_cpu_offload(f32_mixtral):
    s = sizes_of(f32_mixtral)
    plan = plan_multi_gpu(s, Budget(0, GiB, 64), 2, 100 * KiB)
    assert plan.vllm[3:5] == ["--tensor-parallel-size", "2"]
    assert "--data-parallel-size" not in plan.vllm and "--enable-dp-attention" not in plan.sglang
    assert plan.weights_per_gpu == s.total_bytes // 2
    assert plan.vllm[-2:] == ["--cpu-offload-gb", "1"] and not plan.fits
    assert plan.gpus_needed == 4


def test_report_is_json(f32_mixtral):
    full = plan_model(f32_mixtral, Budget(0, MiB, 100), RATES, gpus=2, gpu_bytes=GiB)
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
