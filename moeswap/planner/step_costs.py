"""The runtime's fixed costs per decode step, measured for ``moeswap probe`` on a small synthetic
MoE model written to a scratch folder (random Q8_0 weights: its speed, not its text, matters).

Decode on a small model is not bandwidth-bound: each block costs its torch and dispatch work
(attention, norms, router), and each expert the expert store serves costs its Python and three
product calls. Both are nearly independent of the model's sizes (the bytes are counted apart, at
the probe's rates), so they are measured once here, never on the model being planned:

- ``layer_step``: one decode step of the model all resident (the mapped file), less its bytes
  over ``host_compute``, per block;
- ``expert_call``: the same step with the experts served by an ``ExpertStore`` holding them all
  in host slots, less the resident step, per expert served (k per MoE block).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# The synthetic model: llama-arch MoE, Mixtral's proportions at a toy width.
N_LAYER, N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_EXPERT, TOP_K, N_VOCAB = 4, 256, 512, 4, 2, 8, 2, 512
PROMPT_TOKENS, DECODE_STEPS = 64, 48  # the prompt touches every expert; steps timed: the median
ROUNDS = 3  # resident and stored measured in turn; the fastest of each (the least disturbed)
CONTEXT = PROMPT_TOKENS + DECODE_STEPS


def write_model(path: Path, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    e, f, x, v, kv = N_EMBD, N_FF, N_EXPERT, N_VOCAB, N_EMBD // N_HEAD * N_HEAD_KV
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(e)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(f)
    writer.add_rope_dimension_count(e // N_HEAD)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(x)
    writer.add_expert_used_count(TOP_K)
    writer.add_vocab_size(v)
    tensors = {"token_embd.weight": (v, e), "output_norm.weight": (e,), "output.weight": (v, e)}
    for i in range(N_LAYER):
        tensors.update({
            f"blk.{i}.attn_norm.weight": (e,), f"blk.{i}.attn_q.weight": (e, e),
            f"blk.{i}.attn_k.weight": (kv, e), f"blk.{i}.attn_v.weight": (kv, e),
            f"blk.{i}.attn_output.weight": (e, e), f"blk.{i}.ffn_norm.weight": (e,),
            f"blk.{i}.ffn_gate_inp.weight": (x, e), f"blk.{i}.ffn_gate_exps.weight": (x, f, e),
            f"blk.{i}.ffn_up_exps.weight": (x, f, e), f"blk.{i}.ffn_down_exps.weight": (x, e, f)})
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, dims in tensors.items():
        values = rng.standard_normal(dims, dtype=np.float32) / math.sqrt(dims[-1])
        if name.endswith("norm.weight"):
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
        elif "gate_inp" in name:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def decode_step_seconds(path: Path, threads: int | None, expert_runner=None,
                        context_tokens: int = 0) -> float:
    """The median seconds of one greedy decode step after a prompt (``context_tokens``: what
    the expert runner's budget charged the cache for)."""
    from moeswap.models import load_model

    # validate=False: the probe's model has no tokenizer, which doctor would report
    model = load_model(path, threads=threads, expert_runner=expert_runner,
                       context_tokens=context_tokens, validate=False)
    cache = model.new_cache()
    ids = torch.arange(PROMPT_TOKENS) % (N_VOCAB - 3) + 3
    logits = model.forward([ids], [cache], last_only=True)[0]
    seconds = []
    for _ in range(DECODE_STEPS):
        started = time.perf_counter()
        logits = model.forward([logits[-1:].argmax(-1)], [cache], last_only=True)[0]
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def measure_step_costs(host_compute: float, threads: int | None = None,
                       folder: str | Path | None = None) -> tuple[float, float]:
    """(layer_step, expert_call) seconds on this machine."""
    from moeswap.experts.build import build_store
    from moeswap.experts.settings import OffloadSettings
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.memory import HostCharge
    from moeswap.planner.sizes import model_sizes

    torch_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)  # as `moeswap run --threads` does
    try:
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            path = Path(scratch) / "step-costs.gguf"
            write_model(path)
            gf = GGUFFile.open(path)
            try:
                sizes = model_sizes(gf)
            finally:
                gf.close()
            charge = HostCharge.for_sequence(CONTEXT)
            every_slot = sizes.host_charged(charge) + N_LAYER * N_EXPERT * sizes.slot_bytes
            resident = stored = math.inf
            for _ in range(ROUNDS):
                resident = min(resident, decode_step_seconds(path, threads))
                store = build_store(OffloadSettings(host_bytes=every_slot), charge)
                stored = min(stored, decode_step_seconds(path, threads, store, CONTEXT))
    finally:
        torch.set_num_threads(torch_threads)
    bytes_read = sizes.active_bytes_per_token + sizes.kv_bytes(PROMPT_TOKENS, 4)
    layer_step = (resident - bytes_read / host_compute) / N_LAYER
    expert_call = (stored - resident) / (TOP_K * N_LAYER)
    return max(layer_step, 1e-7), max(expert_call, 1e-7)  # positive, however noisy
