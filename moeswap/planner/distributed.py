"""Launch lines for several GPUs: vLLM and SGLang with expert parallelism.

Flags, as those tools define them: vLLM ``--tensor-parallel-size``, ``--data-parallel-size``,
``--enable-expert-parallel`` (experts sharded over TP x DP ranks instead of tensor-split),
``--cpu-offload-gb`` (GiB of weights per GPU kept in RAM and streamed in), ``--max-model-len``,
``--gpu-memory-utilization``; SGLang ``--tp-size``, ``--ep-size``, ``--dp-size``,
``--enable-dp-attention``, ``--context-length``, ``--mem-fraction-static``.

Layout: MLA caches one latent per token that tensor parallelism cannot split (every TP rank
would hold the whole cache), so an MLA model gets data-parallel attention with the experts
sharded over all GPUs; other models get tensor-parallel attention (kv heads split, replicated
when there are fewer heads than GPUs) with expert parallelism.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from moeswap.planner.placement import Budget, gib
from moeswap.planner.sizes import F16_BYTES, ModelSizes

MEMORY_FRACTION = 0.9  # vLLM's default --gpu-memory-utilization; the rest is the CUDA context


@dataclass(frozen=True)
class MultiGpuPlan:
    gpus: int
    gpu_bytes: int
    data_parallel_attention: bool
    weights_per_gpu: int
    kv_per_gpu: int
    offload_gib_per_gpu: int  # vLLM --cpu-offload-gb; 0 when everything fits
    gpus_needed: int  # the fewest GPUs of this size that hold everything
    vllm: list[str]
    sglang: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.offload_gib_per_gpu == 0

    def commands(self) -> dict[str, str]:
        return {"vllm": shlex.join(self.vllm), "sglang": shlex.join(self.sglang)}


def _per_gpu(sizes: ModelSizes, budget: Budget, gpus: int, dp_attention: bool) -> tuple[int, int]:
    """(weight bytes, KV bytes) one GPU holds."""
    kv = sizes.kv_bytes(budget.context, F16_BYTES, budget.batch)
    if dp_attention:  # attention and shared weights replicated, sequences and experts spread
        kv_here = sizes.kv_bytes(budget.context, F16_BYTES, math.ceil(budget.batch / gpus))
        return sizes.shared_bytes + math.ceil(sizes.routed_bytes / gpus), kv_here
    kv_split = min(gpus, sizes.config.n_head_kv)  # fewer kv heads than GPUs: heads are replicated
    return math.ceil(sizes.total_bytes / gpus), math.ceil(kv / kv_split)


def plan_multi_gpu(sizes: ModelSizes, budget: Budget, gpus: int, gpu_bytes: int) -> MultiGpuPlan:
    c = sizes.config
    dp_attention = bool(c.kv_lora_rank) or c.n_head % gpus != 0
    weights, kv = _per_gpu(sizes, budget, gpus, dp_attention)
    usable = int(gpu_bytes * MEMORY_FRACTION)
    offload = max(0, math.ceil((weights + kv - usable) / 2**30))
    needed = next((n for n in range(1, 4097)
                   if sum(_per_gpu(sizes, budget, n, bool(c.kv_lora_rank) or c.n_head % n != 0))
                   <= usable), 0)
    tp, dp = (1, gpus) if dp_attention else (gpus, 1)
    vllm = ["vllm", "serve", sizes.path, "--tensor-parallel-size", str(tp)]
    if dp > 1:
        vllm += ["--data-parallel-size", str(dp)]
    vllm += ["--enable-expert-parallel", "--max-model-len", str(budget.context),
             "--gpu-memory-utilization", str(MEMORY_FRACTION)]
    if offload:
        vllm += ["--cpu-offload-gb", str(offload)]
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", sizes.path,
              "--tp-size", str(gpus), "--ep-size", str(gpus)]
    if dp_attention:
        sglang += ["--dp-size", str(gpus), "--enable-dp-attention"]
    sglang += ["--context-length", str(budget.context), "--mem-fraction-static",
               str(MEMORY_FRACTION)]
    notes = [f"per GPU: weights {gib(weights)} + KV cache {gib(kv)} (16-bit) of "
             f"{gib(usable)} usable"]
    if sizes.n_expert % gpus:
        notes.append(f"{sizes.n_expert} experts do not divide evenly over {gpus} GPUs: "
                     "some ranks hold one more")
    if offload:
        notes.append(f"does not fit: {gib(weights + kv - usable)} over per GPU; vLLM streams "
                     f"{offload} GiB per GPU from RAM each step (slow); {needed or 'no number of'}"
                     f" GPUs of {gib(gpu_bytes)} hold it all (SGLang needs that many)")
    notes.append("vLLM's GGUF loading is experimental and per architecture: serving the original "
                 "Hugging Face checkpoint (its own size) is the well-trodden path")
    return MultiGpuPlan(gpus, gpu_bytes, dp_attention, weights, kv, offload, needed, vllm, sglang,
                        notes)
