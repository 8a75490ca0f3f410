"""The command line people expect (issue 25): human sizes that read back as flags, budget errors
that name their knobs, piped output that greps and pastes, llama.cpp's flag habits, the chat
REPL's terminal manners, dense models in the planner, and `moeswap probe`'s table."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

import tiny_models
from gguf_builders import MUTATIONS, mixtral
from moeswap.cli import main
from moeswap.gguf_tools.convert import convert
from moeswap.memory import HostCharge, format_size, parse_size

ROOT = Path(__file__).resolve().parent.parent
SIZE = re.compile(r"\d+(\.\d+)?[KMG]iB")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return mixtral().write(tmp_path_factory.mktemp("habits") / "mixtral.gguf")


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    tiny_models.save("gemma3", folder / "hf")
    return convert(folder / "hf", folder / "dense.q8_0.gguf", "q8_0")


# -- 1. human units, and every knob named ---------------------------------------------------

@given(st.integers(0, 1 << 44))
def test_a_formatted_size_reads_back_as_at_least_itself_within_a_hundredth(n):
    text = format_size(n)
    assert re.fullmatch(r"\d+(\.\d{1,2})?([KMG]iB)?", text)
    assert n <= parse_size(text) <= max(n * 1.01, n + 1)


def test_run_refusal_is_in_human_units_and_names_its_knobs(moe_path, capsys):
    assert main(["run", str(moe_path), "-p", "abc", "-n", "4", "--host-mem", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "--host-mem 1KiB is below the shared weights (" in err
    assert re.search(rf"Give --host-mem {SIZE.pattern} or more", err), err
    assert "(--ctx)" in err and "(--step-tokens)" in err
    assert not re.search(r"\d{6,} bytes", err)  # no raw byte counts


def test_a_batch_refusal_names_max_batch():
    terms = {"shared_bytes": 3 << 20, "kv_bytes": 1 << 20, "working_bytes": 1 << 19,
             "staging_bytes": 1 << 18, "lowbit_bytes": 0}
    why = HostCharge.for_batch(512, 8, 64).shortfall(1 << 20, terms, 1 << 18)
    assert why.startswith("--host-mem 1MiB is below the shared weights (3MiB), the KV cache "
                          "(1MiB), the working memory of a step (512KiB) and the staging slots "
                          "(256KiB), which stay in RAM. Give --host-mem 5MiB or more")
    assert "(--max-batch)" in why and "(--ctx)" in why and "(--step-tokens)" in why


def test_plan_refusal_suggests_a_step_and_a_context_that_fit(moe_path, capsys):
    assert main(["plan", str(moe_path), "--host-mem", "4MiB", "--ctx", "4096"]) == 2
    err = capsys.readouterr().err
    step = int(re.search(r"--step-tokens (\d+) fits", err).group(1))
    ctx = int(re.search(r"--ctx (\d+) fits", err).group(1))
    plan = ["plan", str(moe_path), "--host-mem", "4MiB"]
    for flags, fits in [(["--ctx", "4096", "--step-tokens", str(step)], True),
                        (["--ctx", "4096", "--step-tokens", str(step + 1)], False),
                        (["--ctx", str(ctx)], True), (["--ctx", str(ctx + 1)], False)]:
        assert main(plan + flags) == (0 if fits else 2), flags  # the largest that fits
        capsys.readouterr()


# -- 2. piped output -----------------------------------------------------------------------

def test_piped_doctor_greps_whole_keys(tmp_path):
    broken = next(m for m in MUTATIONS if m.name == "wrong_key_type_u64").build(tmp_path)
    done = subprocess.run([sys.executable, "-m", "moeswap", "doctor", str(broken)],
                          capture_output=True, text=True, cwd=ROOT)  # stdout is a pipe
    lines = [line for line in done.stdout.splitlines() if "qwen3moe.expert_count" in line]
    assert lines and "expected type u32" in lines[0]


def test_piped_plan_prints_one_whole_command(moe_path, capsys):
    assert main(["plan", str(moe_path), "--host-mem", "64GiB", "--ctx", "100"]) == 0
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if "--host-mem" in line]
    assert len(commands) == 1
    assert re.fullmatch(rf"  moeswap run \S+ -p PROMPT --host-mem {SIZE.pattern}", commands[0])
    assert max(map(len, out.splitlines())) > 80  # rows are not cut at a terminal's width


def test_piped_inspect_and_stats_keep_identifiers_whole(moe_path, tmp_path, capsys):
    assert main(["inspect", str(moe_path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "blk.1.ffn_gate_exps.weight" in out
    trace = tmp_path / "t.npz"
    assert main(["trace", str(moe_path), "-p", "abcab", "-n", "4", "-o", str(trace)]) == 0
    capsys.readouterr()
    assert main(["stats", str(trace)]) == 0
    footer = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("next guess:")]
    assert len(footer) == 1 and footer[0].endswith("the experts at l and l+1")  # not wrapped


# -- 3. flags -------------------------------------------------------------------------------

def test_version_and_llama_cpp_flags(moe_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and re.fullmatch(r"moeswap \S+\n", capsys.readouterr().out)
    assert main(["run", "-m", str(moe_path), "-p", "abc", "-n", "2", "-t", "1", "--temp", "0",
                 "-c", "64"]) == 0
    assert capsys.readouterr().out.startswith("abc")
    assert main(["plan", "-m", str(moe_path), "-c", "64", "--host-mem", "1GiB"]) == 0


def test_run_ctx_bounds_the_reply_and_refuses_a_prompt_that_fills_it(moe_path, capsys):
    assert main(["run", str(moe_path), "-p", "abc", "-n", "50", "--temp", "0", "-c", "6"]) == 0
    assert "decode: 2 tokens" in capsys.readouterr().err  # 4 prompt ids (BOS + 3) of 6
    assert main(["run", str(moe_path), "-p", "abcabc", "-n", "5", "-c", "4"]) == 2
    assert "--ctx" in capsys.readouterr().err


def test_a_bad_flag_prints_its_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--host-mem", "1GiB", "--ctx", "8", "x.gguf", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: moeswap plan") and "unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        main(["run", "a.gguf", "-m", "b.gguf", "-p", "x"])
    assert "two models given" in capsys.readouterr().err


# -- 4. chat --------------------------------------------------------------------------------

def test_one_ctrl_c_at_the_prompt_asks_and_a_second_quits(monkeypatch):
    import builtins

    from moeswap.chat import QUIT_HINT, _terminal_reader

    answers = iter([KeyboardInterrupt, "hello", KeyboardInterrupt, KeyboardInterrupt])

    def typed(prompt):
        answer = next(answers)
        if answer is KeyboardInterrupt:
            raise KeyboardInterrupt
        return answer

    monkeypatch.setattr(builtins, "input", typed)
    out = io.StringIO()
    read = _terminal_reader(out)
    assert read() == "hello\n"  # one press, then a line: the session goes on
    assert QUIT_HINT in out.getvalue()
    assert read() == ""  # two presses in a row: the end of the session


def test_chat_shows_that_it_is_loading(moe_path, monkeypatch, capsys):
    from rich.progress import Progress

    said = []
    add_task = Progress.add_task  # the progress line: tensors mapped, time (cli/load_report)
    monkeypatch.setattr(Progress, "add_task", lambda self, text, **kw: said.append(text)
                        or add_task(self, text, **kw))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", str(moe_path)]) == 0
    assert said == [f"loading {moe_path}"]
    err = capsys.readouterr().err
    assert f"loaded {moe_path}: " in err and "moeswap chat: memory: " in err


# -- 5. dense models in the planner ---------------------------------------------------------

def test_plan_and_plan_auto_take_a_dense_model(dense_path, capsys):
    assert main(["plan", str(dense_path), "--host-mem", "1GiB", "--device-mem", "8GiB",
                 "--ctx", "256", "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["bytes"]["routed"] == 0 and doc["moeswap"]["experts_total"] == 0
    assert doc["moeswap"]["host_charged_bytes"] > doc["bytes"]["total"]  # weights + KV + step
    assert doc["moeswap"]["command"] == ["moeswap", "run", str(dense_path), "-p", "PROMPT"]
    assert doc["llama_cpp"]["n_gpu_layers"] > 0 and doc["ollama"]["num_gpu"] > 0
    assert main(["run", str(dense_path), "-p", "ab", "-n", "2", "--plan", "auto"]) == 0
    assert "a dense model: every weight stays in RAM" in capsys.readouterr().err
    assert main(["run", str(dense_path), "-p", "ab", "-n", "2", "--host-mem", "1GiB"]) == 2
    assert "is dense (no routed experts)" in capsys.readouterr().err


# -- 6. probe -------------------------------------------------------------------------------

def test_probe_says_what_it_measures_and_prints_a_table_without_gpu_rows(tmp_path, monkeypatch,
                                                                         capsys):
    from moeswap.planner import probe

    steps = []
    monkeypatch.setattr(probe, "DEFAULT_CACHE", tmp_path / "probe.json")
    monkeypatch.setattr(probe, "measure_cpu_compute", lambda kernels: 40e9)
    monkeypatch.setattr(probe, "measure_ram_copy", lambda: 30e9)
    monkeypatch.setattr(probe, "measure_disk_read", lambda folder: 2e9)
    monkeypatch.setattr(probe, "measure_read_seconds", lambda folder: ((4096, 1e-4),))
    monkeypatch.setattr("moeswap.planner.step_costs.measure_step_costs",
                        lambda compute, threads, folder: (1e-3, 2e-4))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    rates = probe.cached_rates(1, tmp_path / "probe.json", on_step=steps.append)
    assert rates.disk_read == 2e9
    assert steps == ["CPU products over Q8_0 bytes", "RAM copies", "cold disk reads"]
    assert main(["probe", "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert "cold disk reads" in out and "2.00 GB/s" in out and "RAM copy" in out
    assert "GPU" not in out.replace("no GPU here", "")


# -- 7. packaging ---------------------------------------------------------------------------

def test_the_licence_is_an_spdx_string():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
