"""The plan as llama.cpp and Ollama command lines.

llama.cpp's placement (DESIGN.md §3, common/arg.cpp): ``-ngl N`` puts the last N blocks on the
GPU (N > n_layer also the output head; the token embedding stays on the CPU); ``--cpu-moe``
and ``--n-cpu-moe N`` add overrides ``blk\\.i\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` -> CPU
(all layers, or i < N); ``-ot "<regex>=CPU"`` is matched with ``std::regex_search`` on the
tensor name, first match wins. A layer's stacked expert tensor cannot be split, so experts go
to the GPU a whole layer at a time. Ollama places whole layers only (``num_gpu``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from moeswap.planner.placement import Budget
from moeswap.planner.rates import PlanRates
from moeswap.planner.sizes import F16_BYTES, ModelSizes
from moeswap.routing.profile import Profile

GPU_RESERVE = 1 << 30  # CUDA context and compute buffers, kept free on the GPU
EXPERT_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's LLM_FFN_EXPS_REGEX


def layer_expert_regex(layers: list[int]) -> str:
    """One regex matching the routed-expert tensors of exactly ``layers``."""
    if len(layers) == 1:
        return rf"blk\.{layers[0]}{EXPERT_PATTERN}"
    return rf"blk\.({'|'.join(str(i) for i in layers)}){EXPERT_PATTERN}"


@dataclass(frozen=True)
class LlamaCppPlan:
    n_gpu_layers: int  # -ngl: the last n blocks; n_layer + 1 adds the output head
    cpu_expert_layers: list[int]  # MoE layers whose experts stay in RAM (mapped file)
    override: str | None  # the -ot regex (None when --n-cpu-moe / --cpu-moe say it)
    gpu_bytes: int
    cpu_bytes: int  # weights the CPU reads from the mapped file
    kv_bytes: int  # f16 cache
    mlock: bool  # the CPU's share fits in --host-mem: pin it
    decode_tokens_per_second: float
    args: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        return shlex.join(self.args)


def kv_bytes(sizes: ModelSizes, budget: Budget) -> int:
    """llama.cpp's f16 cache: sliding layers keep the window and a micro-batch of cells."""
    return sizes.kv_bytes(budget.context, F16_BYTES, budget.batch, sizes.llama_cpp_swa_cells())


def _kv_by_layer(sizes: ModelSizes, budget: Budget) -> float:
    return kv_bytes(sizes, budget) / sizes.config.n_layer


def layers_by_spread(sizes: ModelSizes, profile: Profile) -> list[int]:
    """MoE layers, the ones whose routing spreads widest first: the share of their routes the
    profile's hot set of that layer misses (ties: lower layer). Kept whole on the GPU they
    gain most, since a cache of their hot experts in RAM would serve them least."""
    hot = {layer: set(profile.hot_in_layer(i)) for i, layer in enumerate(profile.layers)}
    deficit = {}
    for i, layer in enumerate(profile.layers):
        counts = profile.counts[i]
        covered = sum(counts[e] for e in hot[layer])
        deficit[layer] = 1 - covered / max(sum(counts), 1)
    return sorted(sizes.moe_layers, key=lambda layer: (-deficit.get(layer, 0.0), layer))


def plan_llama_cpp(sizes: ModelSizes, budget: Budget, rates: PlanRates,
                   profile: Profile | None = None) -> LlamaCppPlan:
    n_layer = sizes.config.n_layer
    kv = kv_bytes(sizes, budget)
    expert_tensor = {layer: size * sizes.n_expert for layer, size in sizes.expert_bytes_by_layer.items()}
    room = max(budget.device_bytes - GPU_RESERVE, 0)
    blocks = sum(sizes.layer_bytes.values()) + sizes.output_bytes + kv
    notes = []
    if room >= blocks:  # every block's attention and the head on the GPU; then whole expert layers
        ngl, left = n_layer + 1, room - blocks
        order = layers_by_spread(sizes, profile) if profile else sorted(sizes.moe_layers, reverse=True)
        gpu_experts = []
        for layer in order:
            if expert_tensor[layer] <= left:
                gpu_experts.append(layer)
                left -= expert_tensor[layer]
            elif not profile:
                break  # --n-cpu-moe keeps a prefix on the CPU: stop at the first that does not fit
        cpu_experts = sorted(set(sizes.moe_layers) - set(gpu_experts))
    else:  # experts all in RAM; as many blocks as fit, from the last
        cpu_experts = list(sizes.moe_layers)
        ngl, used = 0, 0.0
        for layer in reversed(range(n_layer)):
            used += sizes.layer_bytes.get(layer, 0) + _kv_by_layer(sizes, budget)
            if used > room:
                break
            ngl += 1
        if room:
            notes.append(f"the GPU holds {ngl} of {n_layer} blocks without their experts: "
                         f"the rest ({(blocks - room) / 2**30:.2f} GiB more) does not fit")
    gpu_layers = set(range(n_layer - min(ngl, n_layer), n_layer))
    args = ["llama-server", "-m", sizes.path, "-c", str(budget.context * budget.batch)]
    if budget.batch > 1:
        args += ["-np", str(budget.batch)]  # llama-server splits -c among -np slots
    args += ["-ngl", str(ngl)]
    override = None
    if any(layer in gpu_layers for layer in cpu_experts):
        if cpu_experts == sizes.moe_layers:
            args.append("--cpu-moe")
        elif not profile:  # a prefix of the layers: --n-cpu-moe N covers blk.0 .. blk.N-1
            args += ["--n-cpu-moe", str(max(cpu_experts) + 1)]
        else:
            override = layer_expert_regex([i for i in cpu_experts if i in gpu_layers])
            args += ["-ot", f"{override}=CPU"]
    gpu_kv = int(_kv_by_layer(sizes, budget) * len(gpu_layers))
    gpu_weights = sum(sizes.layer_bytes.get(i, 0) + expert_tensor.get(i, 0) * (i not in cpu_experts)
                      for i in gpu_layers) + (sizes.output_bytes if ngl > n_layer else 0)
    cpu_weights = sizes.total_bytes - gpu_weights + (sizes.input_bytes if ngl > n_layer and
                                                     sizes.config.tied_embeddings else 0)
    mlock = cpu_weights + kv - gpu_kv <= budget.host_bytes
    if mlock:
        args.append("--mlock")
    else:
        notes.append(f"the CPU's share ({cpu_weights / 2**30:.2f} GiB) exceeds --host-mem: the OS "
                     "pages experts in from the mapped file as they are used (no --mlock)")
    decode = _decode_estimate(sizes, budget, rates, gpu_layers, cpu_experts, cpu_weights, mlock,
                              ngl > n_layer)
    return LlamaCppPlan(ngl, cpu_experts, override, gpu_weights + gpu_kv, cpu_weights, kv, mlock,
                        decode, args, notes)


def _decode_estimate(sizes: ModelSizes, budget: Budget, rates: PlanRates, gpu_layers: set[int],
                     cpu_experts: list[int], cpu_bytes: int, mlock: bool, head_on_gpu: bool) -> float:
    """One token: each placement's bytes over its rate; experts in a file larger than RAM are
    read from disk in the share that does not fit."""
    r, k = rates.rates, sizes.top_k
    gpu = sum(sizes.layer_bytes.get(i, 0) for i in gpu_layers)
    cpu = sum(b for i, b in sizes.layer_bytes.items() if i not in gpu_layers)
    head = sizes.active_shared_bytes - sum(sizes.layer_bytes.values())
    gpu, cpu = (gpu + head, cpu) if head_on_gpu else (gpu, cpu + head)
    for layer, size in sizes.expert_bytes_by_layer.items():
        if layer in cpu_experts:
            cpu += k * size
        else:
            gpu += k * size
    seconds = gpu / r.device_compute + cpu / r.host_compute
    if not mlock and cpu_bytes:
        miss = max(0.0, 1 - budget.host_bytes / cpu_bytes)
        seconds += miss * k * sum(sizes.expert_bytes_by_layer[i] for i in cpu_experts) / r.disk_read
    return 1 / seconds if seconds else 0.0


def ollama_modelfile(sizes: ModelSizes, budget: Budget) -> tuple[str, int, list[str]]:
    """(Modelfile, layers on the GPU, notes). Ollama offloads whole blocks, experts included."""
    room = max(budget.device_bytes - GPU_RESERVE, 0)
    expert_tensor = {layer: size * sizes.n_expert for layer, size in sizes.expert_bytes_by_layer.items()}
    layers, used = 0, 0.0
    for layer in reversed(range(sizes.config.n_layer)):
        used += sizes.layer_bytes.get(layer, 0) + expert_tensor.get(layer, 0) + _kv_by_layer(sizes, budget)
        if used > room:
            break
        layers += 1
    text = (f"FROM {sizes.path}\nPARAMETER num_ctx {budget.context}\n"
            f"PARAMETER num_gpu {layers}\n")
    notes = ["Ollama places whole blocks (num_gpu): it has no per-tensor placement like "
             "llama.cpp's -ot / --n-cpu-moe, so it cannot keep every block's attention on the GPU "
             "while the experts stay in RAM"] if sizes.moe_layers else []
    if budget.batch > 1:
        notes.append(f"set OLLAMA_NUM_PARALLEL={budget.batch} for {budget.batch} sequences "
                     "(each gets num_ctx)")
    return text, layers, notes
