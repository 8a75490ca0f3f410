"""`moeswap run --plan auto`: the run's budgets are the plan's for the machine's memory."""

from __future__ import annotations

import pytest
from test_planner import RATES, sizes_of

import moeswap
from moeswap.cli import main
from moeswap.memory import format_size, forward_working_bytes, kv_cache_bytes
from moeswap.planner import auto
from moeswap.planner.auto import HOST_RESERVE, Machine, auto_plan
from moeswap.planner.llama_cpp import GPU_RESERVE

MODEL = str(moeswap.DEFAULT_MODEL)
PROMPT = "def add(a, b):"
N_PREDICT = 8
STEP = len(PROMPT.encode()) + 1  # the prompt's most tokens: `run` feeds it in one forward
CONTEXT = STEP + N_PREDICT  # what `run` charges the KV cache for
GiB = 1 << 30


@pytest.fixture(scope="module")
def sizes():
    return sizes_of(MODEL)


def charged(sizes) -> int:
    """Shared weights + the store's KV charge + a forward's working memory + the staging ring:
    the host budget's floor."""
    return (sizes.shared_bytes + kv_cache_bytes(sizes.config, CONTEXT, 1, STEP)
            + forward_working_bytes(sizes.config, STEP, CONTEXT, 1) + sizes.top_k * sizes.slot_bytes)


def machine_with(free_host: int, gpu_free: int = 0) -> Machine:
    """A machine whose free RAM leaves ``free_host`` bytes after the runtime's reserve."""
    return Machine(total_ram=64 * GiB, free_ram=HOST_RESERVE + free_host, gpu_free=gpu_free)


def run(capsys, monkeypatch, machine: Machine | None, *flags: str) -> tuple[int, str, str]:
    if machine is not None:
        monkeypatch.setattr(auto, "machine_memory", lambda: machine)
    # --kv-type f32: the budgets here are ``charged``'s, the library's f32 charge
    code = main(["run", MODEL, "-p", PROMPT, "-n", str(N_PREDICT), "--temp", "0",
                 "--kv-type", "f32", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_budgets_for_a_machine(sizes):
    five = auto_plan(MODEL, CONTEXT, machine_with(charged(sizes) + 5 * sizes.slot_bytes), RATES,
                     step_tokens=STEP)
    assert (five.plan.host_slots, five.plan.device_slots) == (5, 0)
    assert five.host_bytes == charged(sizes) + 5 * sizes.slot_bytes
    assert five.device_bytes == 0
    # Free GPU memory beyond the reserve becomes device slots (Q8_0 experts: computable there).
    gpu = auto_plan(MODEL, CONTEXT, machine_with(charged(sizes) + 2 * sizes.slot_bytes,
                                                 GPU_RESERVE + 3 * sizes.slot_bytes), RATES,
                    step_tokens=STEP)
    assert (gpu.plan.device_slots, gpu.device_bytes) == (3, 3 * sizes.slot_bytes)
    assert gpu.host_bytes == charged(sizes) + 2 * sizes.slot_bytes
    # Room for every expert, no GPU: the all-resident mapped file.
    roomy = auto_plan(MODEL, CONTEXT, machine_with(8 * GiB), RATES, step_tokens=STEP)
    assert roomy.host_bytes is None and roomy.device_bytes == 0
    assert roomy.plan.host_slots == roomy.plan.all_experts


def test_run_uses_the_plans_budgets_and_matches_all_resident(sizes, capsys, monkeypatch):
    budget = charged(sizes) + 5 * sizes.slot_bytes
    code, planned, err = run(capsys, monkeypatch, machine_with(budget), "--plan", "auto")
    assert code == 0
    assert (f"plan auto: --host-mem {format_size(budget)} --device-mem 0: 0 device + 5 host slots"
            in err)
    assert f"host tier: 5/5 slots of {sizes.slot_bytes} bytes" in err
    assert "device tier: 0/0 slots" in err
    code, resident, err = run(capsys, monkeypatch, None)
    assert code == 0 and "tier:" not in err
    assert planned == resident


def test_roomy_machine_runs_all_resident(capsys, monkeypatch):
    code, _, err = run(capsys, monkeypatch, machine_with(8 * GiB), "--plan", "auto")
    assert code == 0
    assert "all resident (no expert store)" in err
    assert "tier:" not in err


def test_explicit_host_mem_wins(sizes, capsys, monkeypatch):
    given = charged(sizes) + 2 * sizes.slot_bytes
    code, _, err = run(capsys, monkeypatch, machine_with(8 * GiB), "--plan", "auto",
                       "--host-mem", str(given))
    assert code == 0
    assert f"--host-mem {format_size(given)} --device-mem 0: 0 device + 2 host slots" in err
    assert f"host tier: 2/2 slots of {sizes.slot_bytes} bytes" in err


def test_impossible_plan_is_refused(sizes, capsys, monkeypatch):
    code, out, err = run(capsys, monkeypatch, machine_with(charged(sizes) // 2), "--plan", "auto")
    assert code == 2 and out == ""
    assert "--plan auto: this machine has" in err
    assert "does not fit" in err and "Change: --host-mem" in err
    # An explicit budget too small gets the planner's message as it is.
    code, out, err = run(capsys, monkeypatch, machine_with(8 * GiB), "--plan", "auto",
                         "--host-mem", "100KiB")
    assert code == 2 and out == ""
    assert "does not fit: --host-mem 100.00 KiB is" in err
    assert "this machine has" not in err
