"""One host charge: the store, `moeswap run`, `moeswap serve`, the benchmark and the planner all
sum what --host-mem pays through moeswap.memory.HostCharge. A term added there (here an extra
12,345 bytes) changes every caller's figure; a caller with its own sum would not move."""

from __future__ import annotations

from moeswap import memory
from moeswap.cli import main
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.store import ExpertStore
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.memory import HostCharge, format_size
from moeswap.quant import CpuKernels

EXTRA = 12345


def add_a_term(monkeypatch) -> None:
    """HostCharge.terms gains one more term of EXTRA bytes."""
    terms = HostCharge.terms

    def with_extra(self, *args, **kwargs):
        return terms(self, *args, **kwargs) | {"extra_bytes": EXTRA}

    monkeypatch.setattr(HostCharge, "terms", with_extra)
    monkeypatch.setitem(memory.CHARGE_WORDS, "extra_bytes", "the extra term")


def figures(path) -> dict[str, int]:
    """What each caller charges for one sequence of 40 positions fed 8 tokens a step."""
    from moeswap.bench.scenarios import ModelFacts
    from moeswap.planner.placement import Budget, make_plan
    from moeswap.planner.rates import plan_rates
    from moeswap.planner.sizes import model_sizes
    from moeswap.server.batching import BatchOptions
    from moeswap.server.budget import batch_charge

    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    charge = HostCharge.for_sequence(40, 8)
    store = ExpertStore(gguf, CpuKernels(1), config.moe_layers, config.expert_act,
                        OffloadSettings(host_bytes=1 << 30), charge)
    served = ExpertStore(gguf, CpuKernels(1), config.moe_layers, config.expert_act,
                         OffloadSettings(host_bytes=1 << 30),
                         batch_charge(BatchOptions(max_batch=2, ctx=40, step_tokens=8)))
    sizes = model_sizes(gguf)
    plan = make_plan(sizes, Budget(0, 1 << 30, 40, step_tokens=8), plan_rates({}))
    return {"store": store.residency.charged["host"], "serve": served.residency.charged["host"],
            "bench": ModelFacts.of(str(path)).budget(0, charge),
            "planner": sizes.host_charged(charge), "plan": plan.host_charged}


def test_every_caller_charges_through_host_charge(mixtral_file, monkeypatch):
    before = figures(mixtral_file)
    assert before["store"] == before["bench"] == before["planner"] == before["plan"]
    add_a_term(monkeypatch)
    after = figures(mixtral_file)
    assert {name: after[name] - before[name] for name in before} == dict.fromkeys(before, EXTRA)


def test_run_refuses_a_budget_the_new_term_no_longer_fits(mixtral_file, monkeypatch, capsys):
    """`moeswap run` at exactly its floor runs (every expert read from the file); with the
    extra term the same budget is refused, and the message names the term."""
    gguf = GGUFFile.open(mixtral_file)
    config = config_from_gguf(gguf)
    prompt = "abc"
    context, step = len(prompt) + 1 + 2, len(prompt) + 1  # as run counts: bytes + BOS, -n 2
    store = ExpertStore(gguf, CpuKernels(1), config.moe_layers, config.expert_act,
                        OffloadSettings(host_bytes=1 << 30),
                        HostCharge.for_sequence(context, step))
    budget = str(store.residency.charged["host"])
    args = ["run", str(mixtral_file), "-p", prompt, "-n", "2", "--temp", "0", "--threads", "1",
            "--prefetch", "off", "--host-mem", budget]
    assert main(args) == 0
    capsys.readouterr()
    add_a_term(monkeypatch)
    assert main(args) == 2
    assert f"the extra term ({format_size(EXTRA)})" in capsys.readouterr().err
