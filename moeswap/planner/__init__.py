"""The memory planner: the arithmetic of a MoE GGUF against the user's hardware, from the header.

``plan_model`` reads the file's header and tensor index (no tensor data), and returns
moeswap's own plan (``placement``), the same budgets as llama.cpp and Ollama settings
(``llama_cpp``) and, for several GPUs, vLLM and SGLang launch lines (``distributed``).
``report`` turns it into the JSON ``moeswap plan --json`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moeswap.formats.gguf_file import GGUFFile
from moeswap.memory import COMMAND_KV_TYPE, STEP_TOKENS, format_size
from moeswap.planner.distributed import MultiGpuPlan, plan_multi_gpu
from moeswap.planner.llama_cpp import LlamaCppPlan, ollama_modelfile, plan_llama_cpp
from moeswap.planner.placement import Budget, Plan, make_plan
from moeswap.planner.rates import PlanRates
from moeswap.planner.sizes import F16_BYTES, model_sizes
from moeswap.routing.profile import Profile
from moeswap.routing.traces import RoutingTrace


@dataclass(frozen=True)
class FullPlan:
    moeswap: Plan
    llama_cpp: LlamaCppPlan
    ollama: tuple[str, int, list[str]]  # Modelfile, layers on the GPU, notes
    multi_gpu: MultiGpuPlan | None
    profile_path: str | None


def plan_model(path: str | Path, budget: Budget, rates: PlanRates, profile_path: str | None = None,
               gpus: int = 0, gpu_bytes: int = 0) -> FullPlan:
    """``profile_path``: a profile (.json: its hot set pinned) or a routing trace (.npz: the
    store's default LRU replayed over it; llama.cpp's plan then has no profile)."""
    profile = trace = None
    if profile_path and is_trace(profile_path):
        trace = RoutingTrace.load(profile_path)
    elif profile_path:
        profile = Profile.load(profile_path)
    gf = GGUFFile.open(path)
    try:
        sizes = model_sizes(gf)
    finally:
        gf.close()
    plan = make_plan(sizes, budget, rates, profile, trace)
    multi = plan_multi_gpu(sizes, budget, gpus, gpu_bytes) if gpus > 1 else None
    return FullPlan(plan, plan_llama_cpp(sizes, budget, rates, profile),
                    ollama_modelfile(sizes, budget), multi, profile_path)


def is_trace(path: str | Path) -> bool:
    return str(path).endswith(".npz")


def moeswap_command(full: FullPlan) -> list[str]:
    """``moeswap run`` with the plan's budgets (and a profile's hot set pinned)."""
    p = full.moeswap
    args = ["moeswap", "run", p.sizes.path, "-p", "PROMPT"]
    if p.all_experts:  # a dense model has no expert store: its weights all stay in RAM
        args += ["--host-mem", format_size(p.budget.host_bytes)]
    if p.budget.step_tokens != STEP_TOKENS:
        args += ["--step-tokens", str(p.budget.step_tokens)]
    if p.budget.kv_type != COMMAND_KV_TYPE:
        args += ["--kv-type", p.budget.kv_type]
    if p.device_slots:
        args += ["--device-mem", format_size(p.budget.device_bytes)]
    if full.profile_path and not is_trace(full.profile_path):
        args += ["--policy", f"pinned:{full.profile_path}"]
    return args


def report(full: FullPlan) -> dict:
    p, s = full.moeswap, full.moeswap.sizes
    llama = full.llama_cpp
    doc = {
        "model": s.path,
        "architecture": s.config.arch,
        "budget": {"device_bytes": p.budget.device_bytes, "host_bytes": p.budget.host_bytes,
                   "context": p.budget.context, "batch": p.budget.batch,
                   "step_tokens": p.budget.step_tokens, "kv_type": p.budget.kv_type},
        "bytes": {"total": s.total_bytes, "shared": s.shared_bytes, "routed": s.routed_bytes,
                  "one_expert": s.one_expert_bytes, "active_per_token": s.active_bytes_per_token},
        "kv_cache": {"bytes_per_token_f16": s.kv_bytes(1, F16_BYTES),
                     "context_bytes_f16": s.kv_bytes(p.budget.context, F16_BYTES, p.budget.batch),
                     "sliding_window": s.config.sliding_window,
                     "mla_latent": s.config.kv_lora_rank,
                     "moeswap_charge_bytes": p.kv_bytes},
        "moeswap": {
            "host_charged_bytes": p.host_charged, "working_bytes": p.working_bytes,
            "staging_bytes": p.staging_bytes,
            "slot_bytes": s.slot_bytes, "device_slots": p.device_slots, "host_slots": p.host_slots,
            "experts_resident": p.resident_experts, "experts_total": p.all_experts,
            "resident_per_layer": {str(k): v for k, v in p.resident_by_layer.items()},
            "experts_on_disk_bytes": p.disk_expert_bytes,
            "hit_rate": {"device": p.hits.device, "host": p.hits.host, "total": p.hits.total,
                         "source": p.hits.source},
            "decode_tokens_per_second": p.decode_tokens_per_second,
            "prefill_tokens_per_second": p.prefill_tokens_per_second,
            "rates": {"disk_read": p.rates.rates.disk_read, "link": p.rates.rates.link,
                      "host_compute": p.rates.rates.host_compute,
                      "device_compute": p.rates.rates.device_compute, "source": p.rates.source},
            "command": moeswap_command(full),
        },
        "llama_cpp": {"n_gpu_layers": llama.n_gpu_layers, "cpu_expert_layers": llama.cpu_expert_layers,
                      "override_regex": llama.override, "gpu_bytes": llama.gpu_bytes,
                      "cpu_bytes": llama.cpu_bytes, "kv_bytes_f16": llama.kv_bytes,
                      "mlock": llama.mlock,
                      "decode_tokens_per_second": llama.decode_tokens_per_second,
                      "command": llama.args, "notes": llama.notes},
        "ollama": {"modelfile": full.ollama[0], "num_gpu": full.ollama[1], "notes": full.ollama[2]},
    }
    if full.multi_gpu:
        m = full.multi_gpu
        doc["multi_gpu"] = {"gpus": m.gpus, "gpu_bytes": m.gpu_bytes,
                            "data_parallel_attention": m.data_parallel_attention,
                            "weights_per_gpu": m.weights_per_gpu, "kv_per_gpu": m.kv_per_gpu,
                            "fits": m.fits, "cpu_offload_gb": m.offload_gib_per_gpu,
                            "gpus_needed": m.gpus_needed, "vllm": m.vllm, "sglang": m.sglang,
                            "notes": m.notes}
    return doc
