"""The benchmark's scenarios and the runs each one makes.

Scenarios (inputs shipped in the package, ``moeswap/bench/inputs/``):

- ``long``: one long multi-turn conversation, prompt filling the context up to ``long_context``
  tokens (8192 at full size), then a greedy continuation.
- ``batch8``: 8 distinct prompts at once; moeswap decodes them together through the server's
  batching code, llama.cpp (one sequence per context here) one after another.
- ``conflict``: a prompt whose topic jumps every few lines, so routing keeps changing.
- ``window-sweep``: the conflict prompt with ``--policy window:N`` for several N.
- ``resident-sweep``: the conflict prompt with budgets of 0 / 4 / 8 / 16 resident experts per
  MoE layer (capped at the model's expert count).

Every run is a ``RunSpec``, a plain record a worker process executes (moeswap.bench.worker).
A moeswap run with an expert store charges its host budget what the command it stands for
charges (``store_charge``, a moeswap.memory.HostCharge): prompts run one after another as
`moeswap run` charges its one sequence, the batch8 run (the server's scheduler) as `moeswap
serve` charges a batch, both fed ``prefill_chunk`` tokens per forward (their ``--step-tokens``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from moeswap.errors import MoeswapError
from moeswap.experts.settings import OffloadSettings
from moeswap.formats.config import ModelConfig
from moeswap.memory import COMMAND_KV_TYPE, HostCharge

SCENARIOS = ("long", "batch8", "conflict", "window-sweep", "resident-sweep")
ENGINES = ("moeswap", "llama.cpp")
PREFILL_CHUNK = 512  # prompt tokens per forward call, both engines (llama.cpp's n_batch)


@dataclass(frozen=True)
class Sizes:
    long_context: int  # positions of the long scenario: prompt + generated
    gen_tokens: int  # generated per sequence in every scenario
    prompt_cap: int | None = None  # prompts cut to this many tokens (smoke runs)


SIZES = {"full": Sizes(long_context=8192, gen_tokens=32),
         "smoke": Sizes(long_context=40, gen_tokens=4, prompt_cap=16)}


@dataclass(frozen=True)
class RunSpec:
    scenario: str
    label: str
    engine: str  # "moeswap" or "llama.cpp"
    model: str
    threads: int
    prompts: list[list[int]]
    gen_tokens: int
    n_ctx: int  # positions per sequence, given to both engines explicitly
    batched: bool = False  # moeswap: all prompts through the server's batch scheduler
    offload: OffloadSettings | None = None  # the expert store's; None: all resident
    budget_bytes: int | None = None  # the RAM budget given; None: the engine takes no budget
    resident_per_layer: int | None = None  # resident-sweep's x
    window: int | None = None  # window-sweep's x
    llama_mmap: bool = True  # llama.cpp: weights mapped (page cache) or read into RAM
    replay_routing: str | None = None  # moeswap: a trace's routing replaces the router's
    prefill_chunk: int = PREFILL_CHUNK
    warm_page_cache: bool = True  # read the file once first; off: a cold-reads run starts cold
    kv_type: str = COMMAND_KV_TYPE  # moeswap's --kv-type; llama.cpp's type_k and type_v
    prompt_repeats: int = 1  # each prompt fed this many times, its time the median

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "prompts"} | {
            "prompt_lengths": [len(p) for p in self.prompts],
            "offload": asdict(self.offload) if self.offload is not None else None}


@dataclass(frozen=True)
class Inputs:
    """The scenario texts, read from the inputs folder."""

    conversation: str
    batch_prompts: list[str]
    conflict: str

    @classmethod
    def read(cls, folder: Path) -> "Inputs":
        names = ("long_conversation.json", "batch8_prompts.json", "conflict_prompt.txt")
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise MoeswapError(f"{folder}: the benchmark inputs {', '.join(missing)} are missing; "
                               "point --inputs at a folder that holds them")
        turns = json.loads((folder / names[0]).read_text())["turns"]
        conversation = "".join(f"### {t['role'].title()}\n{t['content']}\n" for t in turns)
        prompts = json.loads((folder / names[1]).read_text())["prompts"]
        return cls(conversation, prompts, (folder / names[2]).read_text())


@dataclass(frozen=True)
class ModelFacts:
    """What budgets are computed from: bytes that always stay in RAM and one expert's slot."""

    path: str
    file_bytes: int
    n_expert: int
    n_used: int
    moe_layers: int
    slot_bytes: int
    shared_bytes: int
    config: ModelConfig = field(repr=False)

    @classmethod
    def of(cls, path: str) -> "ModelFacts":
        from moeswap.experts.store import shared_bytes
        from moeswap.experts.tiers import slot_bytes
        from moeswap.formats.config import config_from_gguf
        from moeswap.formats.gguf_file import GGUFFile
        from moeswap.models.quant_experts import ExpertLayout

        gguf = GGUFFile.open(path)
        config = config_from_gguf(gguf)
        if not config.moe_layers:
            raise MoeswapError(f"{path}: this {config.arch} model has no routed experts; the "
                               "benchmark's offload runs need an MoE model")
        layouts = [ExpertLayout.from_file(gguf, i) for i in config.moe_layers]
        return cls(str(path), Path(path).stat().st_size, config.n_expert, config.n_expert_used,
                   len(config.moe_layers), slot_bytes(layouts),
                   shared_bytes(gguf, config.moe_layers), config)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "config"}

    def budget(self, experts_per_layer: int, charge: HostCharge) -> int:
        """The host budget that leaves room for ``experts_per_layer`` experts in every MoE layer
        beside what the store charges for ``charge`` (its staging slots: one per pick)."""
        staging = max(self.n_used, 1) * self.slot_bytes
        fixed = charge.bytes(self.config, self.shared_bytes, staging)
        return fixed + experts_per_layer * self.moe_layers * self.slot_bytes


def batch_options(spec: RunSpec):
    """The server scheduler's options for a batched run: every prompt at once, each in a
    context of ``n_ctx``, ``prefill_chunk`` tokens per step."""
    from moeswap.server.batching import BatchOptions

    n = len(spec.prompts)
    return BatchOptions(max_batch=n, queue_size=n, ctx=spec.n_ctx, step_tokens=spec.prefill_chunk)


def store_charge(spec: RunSpec) -> HostCharge:
    """What ``spec`` run with an expert store charges: a batched run as `moeswap serve` charges
    its batch (moeswap.server.budget), otherwise as `moeswap run` charges one sequence (one
    prompt's cache at a time) fed at most ``prefill_chunk`` tokens per forward."""
    from moeswap.server.budget import batch_charge

    if spec.batched:
        return batch_charge(batch_options(spec), spec.kv_type)
    return HostCharge.for_sequence(spec.n_ctx, min(spec.prefill_chunk, max(map(len, spec.prompts))),
                                   spec.kv_type)


@dataclass(frozen=True)
class Plan:
    """What to run: scenarios, sizes, the flags' values and the sweeps' points."""

    model: str
    scenarios: tuple[str, ...]
    sizes: Sizes
    threads: int
    offload: OffloadSettings  # the offload flags; its host_bytes is replaced per run
    host_mem: str | None = None  # --host-mem as given (None: the bench picks a budget)
    replay_routing: str | None = None  # a trace whose routing replaces the router's
    compare: tuple[str, ...] = ENGINES
    windows: tuple[int, ...] = (8, 32, 128)
    resident: tuple[int, ...] = (0, 4, 8, 16)
    kv_type: str = COMMAND_KV_TYPE  # of every run's KV cache, both engines (--kv-type)


def cut(ids: list[int], cap: int | None) -> list[int]:
    return ids[:cap] if cap else ids


def build_runs(plan: Plan, inputs: Inputs, encode, facts: ModelFacts) -> list[RunSpec]:
    """Every run of the plan, in order; ``encode`` turns text into the model's token ids, which
    both engines are then given (so they see the same tokens)."""
    s = plan.sizes
    long_ids = encode(inputs.conversation)[: s.long_context - s.gen_tokens]
    if "long" in plan.scenarios and len(long_ids) < s.long_context - s.gen_tokens:
        raise MoeswapError(f"the long conversation is {len(long_ids)} tokens for this model, "
                           f"fewer than --long-context {s.long_context} asks; lower it")
    conflict = cut(encode(inputs.conflict), s.prompt_cap)
    batch = [cut(encode(p), s.prompt_cap) for p in inputs.batch_prompts]
    inputs_of = {
        "long": ([long_ids], s.long_context),
        "batch8": (batch, max(map(len, batch)) + s.gen_tokens),
        "conflict": ([conflict], len(conflict) + s.gen_tokens),
        "window-sweep": ([conflict], len(conflict) + s.gen_tokens),
        "resident-sweep": ([conflict], len(conflict) + s.gen_tokens),
    }
    runs = []
    for scenario in plan.scenarios:
        prompts, n_ctx = inputs_of[scenario]
        base = RunSpec(scenario, "", "moeswap", plan.model, plan.threads, prompts,
                       s.gen_tokens, n_ctx, batched=scenario == "batch8",
                       replay_routing=plan.replay_routing, kv_type=plan.kv_type)
        runs += [r for r in scenario_runs(plan, base, facts, store_charge(base))
                 if r.engine in plan.compare]
    return runs


def scenario_runs(plan: Plan, base: RunSpec, facts: ModelFacts,
                  charge: HostCharge) -> list[RunSpec]:
    """moeswap's runs and llama.cpp's beside them for one scenario. ``charge``: what a store
    charges the host budget for the scenario's KV caches and step (store_charge)."""
    from moeswap.memory import parse_size

    policy, given = plan.offload.policy, plan.host_mem
    quarter = max(facts.n_expert // 4, 1)  # without --host-mem: a quarter of each layer's experts
    budget = parse_size(given) if given else facts.budget(quarter, charge)
    budget_text = given or f"{quarter} experts/layer"

    replayed = " (replayed)" if base.replay_routing else ""  # labelled in every table

    def offload(label: str, host_bytes: int, policy: str = policy, **fields) -> RunSpec:
        settings = replace(plan.offload, host_bytes=host_bytes, policy=policy)
        return replace(base, label=label + replayed, offload=settings, budget_bytes=host_bytes,
                       **fields)

    resident = replace(base, label="moeswap all resident" + replayed)
    # llama.cpp cannot replay a trace: it runs the file's own router
    llama_full = replace(base, label="llama.cpp all in RAM (no mmap)", engine="llama.cpp",
                         llama_mmap=False, replay_routing=None)
    llama_mmap = replace(llama_full, label="llama.cpp mmap (page cache)", llama_mmap=True)
    if base.scenario in ("long", "batch8", "conflict"):
        return [resident,
                offload(f"moeswap {policy}, host {budget_text}", budget),
                llama_full, llama_mmap]
    if base.scenario == "window-sweep":
        return [offload(f"moeswap window:{n}, host {budget_text}", budget, window=n,
                        policy=f"window:{n}") for n in plan.windows] + [llama_full]
    counts = sorted({min(n, facts.n_expert) for n in plan.resident})
    return [offload(f"moeswap {policy}, {n} resident/layer", facts.budget(n, charge),
                    resident_per_layer=n) for n in counts
            ] + [resident, llama_full]
