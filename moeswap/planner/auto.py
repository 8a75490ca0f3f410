"""`moeswap run --plan auto`: plan for this machine's free memory, and the budgets the run uses.

The host budget is the memory free now less a reserve for what the runtime allocates after
planning, which the store does not count. Free is the smaller of the RAM free (MemAvailable,
less HOST_RESERVE: torch, the tokenizer, the OS) and, in a memory cgroup (a container, or
`bench --memory-limit`), the tightest limit on the process's cgroup path less the anonymous
memory held there, which already counts what the runtime holds (less CGROUP_RESERVE:
moeswap.planner.cgroup_memory). The device budget is the free GPU
memory less llama_cpp.GPU_RESERVE, or 0 without CUDA. A budget given as a flag replaces the
machine's. The run then gets exactly what the plan uses — the charged bytes plus its expert
slots — or, when every expert fits in RAM with no device tier, the all-resident mapped file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moeswap.errors import MoeswapError
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.config import config_from_gguf
from moeswap.memory import STEP_TOKENS, HostCharge, format_size
from moeswap.planner.cgroup_memory import CGROUP_ROOT, SELF_CGROUP, cgroup_limit
from moeswap.planner.llama_cpp import GPU_RESERVE
from moeswap.planner.placement import Budget, Plan, gib, make_plan
from moeswap.planner.rates import PlanRates
from moeswap.planner.sizes import model_sizes
from moeswap.routing.profile import Profile

HOST_RESERVE = 1 << 30  # torch, the tokenizer, activations, the OS: outside the store's budget
# In a cgroup the runtime's holdings are already counted (the cgroup's anonymous memory): kept
# back is only what it allocates after planning (the tokenizer, kernel threads' buffers).
CGROUP_RESERVE = 128 << 20


@dataclass(frozen=True)
class Machine:
    total_ram: int  # physical RAM, or the memory cgroup's limit when that is smaller
    free_ram: int  # what can be allocated without swapping (MemAvailable) or past the cgroup
    gpu_free: int = 0  # free CUDA memory; 0 without a GPU
    reserve: int = HOST_RESERVE  # kept back from free_ram for the runtime
    cgroup: str = ""  # the cgroup folder whose limit binds; "" when RAM does


@dataclass(frozen=True)
class AutoPlan:
    plan: Plan
    machine: Machine
    host_bytes: int | None  # the run's --host-mem; None: all resident, no expert store
    device_bytes: int
    notes: list[str]

    def describe(self) -> list[str]:
        p, m = self.plan, self.machine
        gpu = f"GPU {gib(m.gpu_free)} free" if m.gpu_free else "no GPU"
        where = f"memory cgroup {m.cgroup}" if m.cgroup else "RAM"
        lines = [f"plan auto: {where} {gib(m.free_ram)} free of {gib(m.total_ram)}, {gpu}; "
                 f"planned for host {gib(p.budget.host_bytes)}, device "
                 f"{gib(p.budget.device_bytes)}, {p.budget.context} positions"
                 + (f" x {p.budget.batch} sequences" if p.budget.batch > 1 else "")]
        if not p.all_experts:
            lines.append("plan auto: a dense model: every weight stays in RAM (no expert store)")
        elif self.host_bytes is None:
            lines.append(f"plan auto: all {p.all_experts} experts fit in RAM: all resident "
                         "(no expert store)")
        else:
            lines.append(f"plan auto: --host-mem {format_size(self.host_bytes)} --device-mem "
                         f"{format_size(self.device_bytes)}: {p.device_slots} device + "
                         f"{p.host_slots} host "
                         f"slots of {gib(p.sizes.slot_bytes)}, {p.resident_experts} of "
                         f"{p.all_experts} experts resident, expected hit rate "
                         f"{p.hits.total:.1%}")
        lines.append(f"plan auto: predicted decode {p.decode_tokens_per_second:.1f} tokens/s "
                     f"(rates: {p.rates.source})")
        return lines + [f"plan auto: note: {note}" for note in self.notes]


def machine_memory(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> Machine:
    """This machine's RAM (from /proc/meminfo where there is one), capped by the process's
    memory cgroup, and free CUDA memory."""
    import os

    import torch

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        if "MemAvailable" in fields:  # counts reclaimable page cache, unlike SC_AVPHYS_PAGES
            free = int(fields["MemAvailable"].split()[0]) * 1024
    gpu = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    cgroup = cgroup_limit(cgroup_root, self_cgroup)
    if cgroup is not None and cgroup.free - CGROUP_RESERVE < free - HOST_RESERVE:
        return Machine(min(total, cgroup.limit), cgroup.free, gpu, CGROUP_RESERVE,
                       str(cgroup.folder))
    return Machine(total, free, gpu)


def fits_in_ram(model_path, charge: HostCharge | None = None) -> bool:
    """Whether a copy of the GGUF model's files fits the RAM free (or its cgroup's room) beside
    the KV caches and working memory ``charge`` pays and the runtime's reserve: a folder, or a
    model that does not fit, stays mapped. (Repacked weights give the copy's pages back, so
    the copy never holds a weight twice.)"""
    path = Path(model_path)
    if not path.is_file():
        return False
    gguf = GGUFFile.open(path)
    try:
        size = gguf.total_size
        config = config_from_gguf(gguf)
    finally:
        gguf.close()
    more = charge.kv_bytes(config) + charge.working_bytes(config) if charge else 0
    machine = machine_memory()
    return size + more + machine.reserve <= machine.free_ram


def device_computable(path: str | Path) -> bool:
    """Whether every routed expert matrix has a type the CUDA device tier computes."""
    from moeswap.experts.device import DEVICE_TYPES

    gf = GGUFFile.open(path)
    try:
        return all(t.type_id in DEVICE_TYPES for t in gf.tensors if t.name.endswith("_exps.weight"))
    finally:
        gf.close()


def auto_plan(model_path: str | Path, context_tokens: int, machine: Machine, rates: PlanRates,
              host_bytes: int | None = None, device_bytes: int | None = None,
              profile_path: str | None = None, step_tokens: int = STEP_TOKENS,
              kv_type: str = "f32", sequences: int = 1) -> AutoPlan:
    """The plan for ``machine`` (budgets given here win over its memory) and the run's budgets;
    ``step_tokens``: the most tokens one forward feeds (a prompt chunk; 0: a whole context);
    ``kv_type``: of the KV cache the run will keep; ``sequences``: contexts cached at once
    (serve's --max-batch).
    A plan that cannot fit raises the planner's refusal."""
    if Path(model_path).is_dir():
        raise MoeswapError(f"{model_path}: --plan auto reads a GGUF header; convert the folder "
                           "first (moeswap convert) or give --host-mem yourself")
    notes = []
    given_device = device_bytes is not None
    if not given_device:
        device_bytes = max(machine.gpu_free - GPU_RESERVE, 0)
        if device_bytes and not device_computable(model_path):
            notes.append("the GPU tier cannot compute this file's expert types (F32, F16, Q8_0 "
                         "and Q4_0 it can): no device tier")
            device_bytes = 0
    from_machine = host_bytes is None
    if from_machine:
        host_bytes = max(machine.free_ram - machine.reserve, 0)
    gf = GGUFFile.open(model_path)
    try:
        sizes = model_sizes(gf)
    finally:
        gf.close()
    profile = Profile.load(profile_path) if profile_path else None
    try:
        budget = Budget(device_bytes, host_bytes, context_tokens, batch=sequences,
                        step_tokens=step_tokens, kv_type=kv_type)
        plan = make_plan(sizes, budget, rates, profile)
    except MoeswapError as refusal:
        if not from_machine:
            raise
        where = f"its memory cgroup allows {gib(machine.free_ram)} more" if machine.cgroup \
            else f"this machine has {gib(machine.free_ram)} of RAM free"
        raise MoeswapError(f"--plan auto: {where}, "
                           f"{gib(host_bytes)} after {gib(machine.reserve)} kept for the runtime: "
                           f"{refusal}") from None
    if not plan.all_experts:  # a dense model: no expert store, every weight in RAM
        return AutoPlan(plan, machine, None, 0, notes)
    if not from_machine:  # the user's budgets, as given
        return AutoPlan(plan, machine, host_bytes, device_bytes, notes)
    if plan.host_slots == plan.all_experts and not plan.device_slots:
        return AutoPlan(plan, machine, None, 0, notes)
    device = device_bytes if given_device else plan.device_slots * sizes.slot_bytes
    return AutoPlan(plan, machine, plan.host_charged + plan.host_slots * sizes.slot_bytes,
                    device, notes)
