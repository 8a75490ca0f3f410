"""--kv-type q8_0: keys and values as rows of Q8_0 blocks, attended by ggml's flash attention
(moeswap.models.ggml_attention), the only way llama.cpp keeps a quantized V cache.

On Q8_0 files with heads of 32 numbers, the logits equal llama.cpp's run with type_k = type_v =
Q8_0 and flash_attn=True bit for bit, and token by token equals the whole forward (past Gemma
3's windows too), and a cache that grows keeps its rows. The cache holds exactly what is
charged, 34 bytes per 32 numbers: 17/32 of f16's bytes, in `moeswap plan` and the server's
memory panel too. Families whose attention keeps the torch path, Hugging
Face folders and heads that are not whole blocks are refused at load with one line naming the
fix; run, chat, serve, plan and bench take the flag (bench gives llama.cpp the same cache).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tiny_models
from moeswap.cli import build_parser, main
from moeswap.errors import MoeswapError
from moeswap.memory import HostCharge, kv_cache_bytes
from moeswap.models import load_model

PROMPT = torch.randint(0, tiny_models.VOCAB, (40,), generator=torch.Generator().manual_seed(3))
# Heads of 32 numbers, one Q8_0 block (the tiny models' own are 16 but for Qwen3's).
HEADS_OF_32 = {"mixtral": {"head_dim": 32}, "qwen3moe": {}, "olmoe": {"hidden_size": 128},
               "glm4moe": {"head_dim": 32},
               "gemma3": {"head_dim": 32, "query_pre_attn_scalar": 32}}
Q8_0 = 8  # GGML_TYPE_Q8_0, llama.cpp's type_k / type_v


def logits(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    return model.forward([ids], [cache if cache is not None else model.new_cache()])[0]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("family", ["mixtral", "qwen3moe", "olmoe", "glm4moe"])
def test_q8_0_logits_equal_llama_cpps_flash_attention_bit_for_bit(q8_files, family):
    llama_cpp = pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    path = q8_files(family, **HEADS_OF_32[family])
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, type_k=Q8_0,
                          type_v=Q8_0, flash_attn=True, n_threads=2, verbose=False)
    llm.eval(PROMPT.tolist())
    reference = np.array(llm.scores[:len(PROMPT)], dtype=np.float32)
    model = load_model(path, kv_type="q8_0")
    assert np.array_equal(logits(model, PROMPT).numpy(), reference)


@pytest.mark.parametrize("family", ["qwen3moe", "gemma3"])
def test_token_by_token_equals_the_whole_forward(q8_files, family):
    path = q8_files(family, **HEADS_OF_32[family])
    model = load_model(path, kv_type="q8_0")
    whole = logits(model, PROMPT)
    cache = model.new_cache()
    steps = torch.cat([logits(model, PROMPT[i:i + 1], cache) for i in range(len(PROMPT))])
    assert torch.equal(steps, whole)  # also past Gemma 3's 4-position windows (a ring)
    f16 = logits(load_model(path, kv_type="f16"), PROMPT)
    assert tiny_models.relative_error(whole, f16) < 5e-2  # Q8_0 against f16 keys and values
    assert (whole.argmax(-1) == f16.argmax(-1)).float().mean() > 0.9


def test_a_grown_cache_keeps_its_rows(q8_files):
    model = load_model(q8_files("qwen3moe"), kv_type="q8_0")
    ids = torch.randint(0, tiny_models.VOCAB, (300,), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache()
    first = logits(model, ids[:200], cache)  # 256 slots, then 512: the rows copied over
    assert cache._layers[0].capacity == 256
    chunked = torch.cat([first, logits(model, ids[200:], cache)])
    assert cache._layers[0].capacity == 512
    assert torch.equal(chunked, logits(model, ids))


def test_the_cache_holds_what_is_charged_17_32_of_f16(q8_files):
    path = q8_files("gemma3", **HEADS_OF_32["gemma3"])  # full layers and sliding-window rings
    n_tokens, step = 40, 12
    model = load_model(path, context_tokens=n_tokens, step_tokens=step, kv_type="q8_0")
    cache = model.new_cache()
    for at in range(0, n_tokens, step):
        logits(model, PROMPT[at:at + step], cache)
    c = model.config
    charged = kv_cache_bytes(c, n_tokens, step_tokens=step, kv_type="q8_0")
    held = sum(s.keys[:s.filled].nbytes + s.values[:s.filled].nbytes for s in cache._layers)
    assert all(s.keys.dtype == torch.uint8 and s.rows for s in cache._layers)
    assert held == charged == cache.n_floats() * 34 // 32
    assert 32 * charged == 17 * kv_cache_bytes(c, n_tokens, step_tokens=step, kv_type="f16")
    charge = HostCharge.for_batch(64, 3, 8, "q8_0")
    assert 32 * charge.kv_bytes(c) == 17 * HostCharge.for_batch(64, 3, 8, "f16").kv_bytes(c)
    assert charge.working_bytes(c) == HostCharge.for_batch(64, 3, 8).working_bytes(c)


def test_plan_kv_line_for_q8_0_is_17_32_of_f16s(q8_files, capsys):
    path = q8_files("qwen3moe")

    def plan(*flags: str) -> dict:
        assert main(["plan", str(path), "--host-mem", "1GiB", "--ctx", "256", "--json",
                     *flags]) == 0
        return json.loads(capsys.readouterr().out)

    f16, q8 = plan(), plan("--kv-type", "q8_0")
    # Qwen3: 2 layers x (K=2 heads x E=32) x keys and values = 256 numbers per position
    assert f16["kv_cache"]["moeswap_charge_bytes"] == 256 * 256 * 2
    assert q8["kv_cache"]["moeswap_charge_bytes"] == 256 * 256 * 34 // 32 == 69632
    assert q8["moeswap"]["command"][-2:] == ["--kv-type", "q8_0"]


def test_the_server_memory_panel_names_and_charges_q8_0(q8_files):
    from moeswap.runtime import load
    from moeswap.server.batching import BatchOptions
    from moeswap.server.memory_panel import memory_view

    runtime = load(str(q8_files("qwen3moe")), threads=1, kv_type="q8_0")
    view = memory_view(runtime, BatchOptions(max_batch=2, ctx=64, step_tokens=8))
    assert view["kv_type"] == "q8_0"
    assert view["kv_bytes"] == HostCharge.for_batch(64, 2, 8, "q8_0").kv_bytes(runtime.config)


@pytest.mark.parametrize("family, why", [("gpt_oss", "attention sinks"),
                                         ("deepseek2", "its attention is MLAttention"),
                                         ("llama4_scout", "its attention is Llama4Attention"),
                                         ("gemma4", "its attention is Gemma4Attention")])
def test_a_torch_path_family_is_refused(q8_files, family, why):
    path = q8_files(family)
    with pytest.raises(MoeswapError) as refused:
        load_model(path, kv_type="q8_0")
    message = str(refused.value)
    assert message.startswith(f"{path}: --kv-type q8_0 is read only by ggml's attention graphs")
    assert why in message and message.endswith("use --kv-type f16") and "\n" not in message


def test_a_folder_and_graphs_off_are_refused(q8_files, tmp_path):
    tiny_models.save("qwen3moe", tmp_path)
    with pytest.raises(MoeswapError, match="a Hugging Face folder does not use; use --kv-type f16"):
        load_model(tmp_path, kv_type="q8_0")
    with pytest.raises(MoeswapError, match=r"load_model\(graphs=False\) does not use"):
        load_model(q8_files("qwen3moe"), kv_type="q8_0", graphs=False)


def test_heads_that_are_not_whole_blocks_are_refused(q8_files, capsys):
    path = q8_files("mixtral")  # heads of 16 numbers
    capsys.readouterr()
    with pytest.raises(MoeswapError, match=r"in blocks of 32 numbers, and llama's heads have 16; "
                                           r"use --kv-type f16$"):
        load_model(path, kv_type="q8_0")
    assert main(["run", str(path), "-p", "hi", "-n", "1", "--kv-type", "q8_0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeswap: error: ")
    assert lines[0].endswith("use --kv-type f16")


@pytest.mark.parametrize("command", [["run", "M", "-p", "hi"], ["chat", "M"], ["serve", "M"],
                                     ["plan", "M", "--ctx", "64"], ["bench", "M"]])
def test_the_commands_take_kv_type_q8_0(command):
    assert build_parser().parse_args([*command, "--kv-type", "q8_0"]).kv_type == "q8_0"


def test_run_with_a_q8_0_cache(q8_files, capsys):
    path = q8_files("qwen3moe")
    assert main(["run", str(path), "-p", "hi", "-n", "3", "--temp", "0", "--kv-type", "q8_0",
                 "--ctx", "64"]) == 0
    assert capsys.readouterr().out


@pytest.mark.llama_cpp
def test_bench_runs_both_engines_with_a_q8_0_cache(tmp_path):
    """The built-in model (heads of 32): moeswap resident and offloaded, and llama.cpp with a
    Q8_0 cache and flash attention, decode the same 8 greedy tokens."""
    pytest.importorskip("llama_cpp", reason="the llama.cpp side needs llama-cpp-python")
    import moeswap
    from moeswap.bench.llama_cpp_runner import kv_arguments

    assert kv_arguments("q8_0") == {"type_k": Q8_0, "type_v": Q8_0, "flash_attn": True}
    assert main(["bench", str(moeswap.DEFAULT_MODEL), "--size", "smoke", "--gen-tokens", "8",
                 "--threads", "1", "-o", str(tmp_path), "--scenarios", "conflict",
                 "--compare", "llama.cpp", "--kv-type", "q8_0"]) == 0
    runs = json.loads((tmp_path / "report.json").read_text())["runs"]
    assert len(runs) == 4 and all(r["status"] == "ok" for r in runs), runs
    assert all(r["kv_type"] == "q8_0" for r in runs)
    assert all(r["outputs"] == runs[-1]["outputs"] for r in runs)
