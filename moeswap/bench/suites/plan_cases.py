"""``--suite plan cases``: the seeds' two worked cases planned from GGUF headers of the real
published shapes (was scripts/plan_worked_cases.py).

Writes two header-only GGUF files into --work-dir whose tensor data is a sparse hole (the
planner reads only the header and tensor index), with llama.cpp's tensor names and an
approximation of its Q4_K_M type mix (Q4_K; Q6_K for ffn_down / attn_v on llama.cpp's "more
bits" layers and the output head; rows not a multiple of 256 fall back to Q5_0 / Q8_0 as
llama.cpp does; norms, routers and scales F32), then plans (``moeswap plan``'s figures):

- DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers, n_embd 2048, 16 heads,
  MLA with kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128, no q_lora; 64 routed experts of
  width 1408 + 2 shared, top-6, first layer dense of width 10944; vocabulary 102400) on a 12 GB
  GPU with 32 GB RAM, 8192 context, and on a 6 GB GPU;
- Gemma-4-26B-A4B (google/gemma-4-26B-A4B text_config: 30 layers, n_embd 2816, 16 heads;
  sliding layers 8 kv heads of 256 with a 1024 window, every 6th layer global with 2 kv heads of
  512 and keys reused as values; 128 experts of width 704, top-8, a dense GeGLU FFN of 2112
  beside them; vocabulary 262144, tied head) on a 24 GB GPU with 32 GB RAM, 32768 context, and
  on 2 GPUs of 16 GB (vLLM / SGLang lines).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

GB = 10**9
# GB/s of the machine the seeds describe, not this one: a consumer GPU's product over quantized
# bytes, PCIe 4.0 x16 as used, dual-channel DDR5 through the CPU kernels, an NVMe Gen4 SSD
# (`moeswap plan --gpu-bw 400 --link-bw 25 --ram-bw 60 --disk-bw 7`).
ASSUMED_RATES = {"device_compute": 400e9, "link": 25e9, "host_compute": 60e9, "disk_read": 7e9}
# (file, device GB, host GB, context, GPUs, GB per GPU): `moeswap plan`'s --device-mem,
# --host-mem, --ctx, --gpus, --gpu-mem
CASES = (("deepseek", 12, 32, 8192, 0, 0), ("deepseek", 6, 32, 8192, 0, 0),
         ("gemma", 24, 32, 32768, 0, 0), ("gemma", 24, 32, 32768, 2, 16))


def more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third layer between."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def q4_k_m(name: str, ne: tuple[int, ...], layer: int | None, n_layer: int) -> Q:
    if len(ne) == 1 or "ffn_gate_inp" in name or name.endswith(".scale"):
        return Q.F32
    wants = Q.Q4_K
    if name == "output.weight" or (layer is not None and more_bits(layer, n_layer)
                                   and ("ffn_down" in name or "attn_v" in name)):
        wants = Q.Q6_K
    if ne[0] % 256:
        return Q.Q8_0 if wants == Q.Q6_K else Q.Q5_0
    return wants


def write_header(path: Path, arch: str, keys: dict, tensors: list[tuple[str, tuple, int | None]],
                 n_layer: int) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    for key, (value, vtype) in keys.items():
        if isinstance(value, list):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, vtype)
        else:
            writer.add_key_value(key, value, vtype)
    data_bytes = 0
    for name, ne, layer in tensors:
        qtype = q4_k_m(name, ne, layer, n_layer)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(ne)) // block * size
        writer.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), n_bytes,
                               raw_dtype=qtype)
        data_bytes += -(-n_bytes // 32) * 32
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    os.truncate(path, path.stat().st_size + data_bytes)  # a sparse hole where the data would be
    return path


def u32(value):
    return value, gguf.GGUFValueType.UINT32


def f32(value):
    return value, gguf.GGUFValueType.FLOAT32


def deepseek_v2_lite(path: Path) -> Path:
    a, L, D = "deepseek2", 27, 2048
    keys = {f"{a}.{k}": v for k, v in {
        "block_count": u32(L), "context_length": u32(163840), "embedding_length": u32(D),
        "feed_forward_length": u32(10944), "attention.head_count": u32(16),
        "attention.head_count_kv": u32(1), "attention.key_length": u32(576),
        "attention.value_length": u32(512), "attention.key_length_mla": u32(192),
        "attention.value_length_mla": u32(128), "attention.kv_lora_rank": u32(512),
        "attention.layer_norm_rms_epsilon": f32(1e-6), "rope.dimension_count": u32(64),
        "rope.freq_base": f32(10000.0), "expert_count": u32(64), "expert_used_count": u32(6),
        "expert_shared_count": u32(2), "expert_feed_forward_length": u32(1408),
        "leading_dense_block_count": u32(1), "expert_gating_func": u32(1),
        "expert_weights_scale": f32(1.0), "vocab_size": u32(102400)}.items()}
    tensors = [("token_embd.weight", (D, 102400), None)]
    for i in range(L):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (D,), i), (p + "attn_q.weight", (D, 16 * 192), i),
                    (p + "attn_kv_a_mqa.weight", (D, 576), i), (p + "attn_kv_a_norm.weight", (512,), i),
                    (p + "attn_k_b.weight", (128, 512, 16), i), (p + "attn_v_b.weight", (512, 128, 16), i),
                    (p + "attn_output.weight", (16 * 128, D), i), (p + "ffn_norm.weight", (D,), i)]
        if i == 0:
            tensors += [(p + "ffn_gate.weight", (D, 10944), i), (p + "ffn_up.weight", (D, 10944), i),
                        (p + "ffn_down.weight", (10944, D), i)]
            continue
        tensors += [(p + "ffn_gate_inp.weight", (D, 64), i),
                    (p + "ffn_gate_exps.weight", (D, 1408, 64), i),
                    (p + "ffn_up_exps.weight", (D, 1408, 64), i),
                    (p + "ffn_down_exps.weight", (1408, D, 64), i),
                    (p + "ffn_gate_shexp.weight", (D, 2816), i), (p + "ffn_up_shexp.weight", (D, 2816), i),
                    (p + "ffn_down_shexp.weight", (2816, D), i)]
    tensors += [("output_norm.weight", (D,), None), ("output.weight", (D, 102400), None)]
    return write_header(path, a, keys, tensors, L)


def gemma4_26b(path: Path) -> Path:
    a, L, D = "gemma4", 30, 2816
    swa = [i % 6 != 5 for i in range(L)]
    keys = {f"{a}.{k}": v for k, v in {
        "block_count": u32(L), "context_length": u32(262144), "embedding_length": u32(D),
        "feed_forward_length": u32(2112), "attention.head_count": u32(16),
        "attention.head_count_kv": ([8 if s else 2 for s in swa], gguf.GGUFValueType.UINT32),
        "attention.key_length": u32(512), "attention.value_length": u32(512),
        "attention.key_length_swa": u32(256), "attention.value_length_swa": u32(256),
        "attention.sliding_window": u32(1024),
        "attention.sliding_window_pattern": (swa, gguf.GGUFValueType.BOOL),
        "attention.shared_kv_layers": u32(0), "embedding_length_per_layer_input": u32(0),
        "attention.layer_norm_rms_epsilon": f32(1e-6), "rope.dimension_count": u32(512),
        "rope.dimension_count_swa": u32(256), "rope.freq_base": f32(1e6),
        "rope.freq_base_swa": f32(1e4), "final_logit_softcapping": f32(30.0),
        "expert_count": u32(128), "expert_used_count": u32(8),
        "expert_feed_forward_length": u32(704)}.items()}
    tensors = [("token_embd.weight", (D, 262144), None), ("rope_freqs.weight", (256,), None)]
    for i, s in enumerate(swa):
        p, hd, kv = f"blk.{i}.", (256 if s else 512), (8 if s else 2)
        tensors += [(p + "attn_norm.weight", (D,), i), (p + "attn_q.weight", (D, 16 * hd), i),
                    (p + "attn_k.weight", (D, kv * hd), i),
                    *([(p + "attn_v.weight", (D, kv * hd), i)] if s else []),  # global: K = V
                    (p + "attn_q_norm.weight", (hd,), i),
                    (p + "attn_k_norm.weight", (hd,), i), (p + "attn_output.weight", (16 * hd, D), i),
                    (p + "post_attention_norm.weight", (D,), i), (p + "ffn_norm.weight", (D,), i),
                    (p + "ffn_gate.weight", (D, 2112), i), (p + "ffn_up.weight", (D, 2112), i),
                    (p + "ffn_down.weight", (2112, D), i), (p + "pre_ffw_norm_2.weight", (D,), i),
                    (p + "ffn_gate_inp.weight", (D, 128), i), (p + "ffn_gate_inp.scale", (D,), i),
                    (p + "ffn_gate_up_exps.weight", (D, 1408, 128), i),
                    (p + "ffn_down_exps.weight", (704, D, 128), i),
                    (p + "ffn_down_exps.scale", (128,), i), (p + "post_ffw_norm_1.weight", (D,), i),
                    (p + "post_ffw_norm_2.weight", (D,), i), (p + "post_ffw_norm.weight", (D,), i),
                    (p + "layer_output_scale.weight", (1,), i)]
    tensors += [("output_norm.weight", (D,), None)]
    return write_header(path, a, keys, tensors, L)


def plan_cases(work_dir: Path) -> tuple[dict, str]:
    """Writes the two header files and plans the four cases -> (report body, markdown)."""
    from moeswap.planner import plan_model, report
    from moeswap.planner.placement import Budget
    from moeswap.planner.rates import plan_rates

    work_dir.mkdir(parents=True, exist_ok=True)
    files = {"deepseek": deepseek_v2_lite(work_dir / "deepseek-v2-lite-q4_k_m.header.gguf"),
             "gemma": gemma4_26b(work_dir / "gemma-4-26b-a4b-q4_k_m.header.gguf")}
    rates = plan_rates(ASSUMED_RATES)
    docs, lines = [], []
    for name, device, host, ctx, gpus, gpu_gb in CASES:
        flags = f"--device-mem {device}GB --host-mem {host}GB --ctx {ctx}" + \
            (f" --gpus {gpus} --gpu-mem {gpu_gb}GB" if gpus else "") + \
            " --gpu-bw 400 --link-bw 25 --ram-bw 60 --disk-bw 7"
        full = plan_model(files[name], Budget(device * GB, host * GB, ctx), rates, None, gpus,
                          gpu_gb * GB)
        docs.append({"flags": flags, "plan": report(full)})
        lines += [f"### `moeswap plan {files[name].name} {flags}`", "",
                  *plan_text(docs[-1]["plan"]), ""]
    return {"work_dir": str(work_dir), "cases": docs}, "\n".join(lines)


def plan_text(doc: dict) -> list[str]:
    """The figures `moeswap plan` prints, as markdown."""
    from moeswap.planner.placement import gib

    b, kv, m, llama = doc["bytes"], doc["kv_cache"], doc["moeswap"], doc["llama_cpp"]
    rows = [
        ("weights, total", gib(b["total"])),
        ("shared (attention, norms, routers, shared experts, head)", gib(b["shared"])),
        ("routed experts, all", gib(b["routed"])),
        ("one expert of one layer", gib(b["one_expert"])),
        ("read per token (shared + top-k experts)", gib(b["active_per_token"])),
        ("KV cache per token (16-bit)", gib(kv["bytes_per_token_f16"])),
        ("KV cache for the context (16-bit)", gib(kv["context_bytes_f16"])),
        ("moeswap: RAM for shared + KV (f32) + step + staging", gib(m["host_charged_bytes"])),
        (f"moeswap: a step's working memory (--step-tokens {doc['budget']['step_tokens']})",
         gib(m["working_bytes"])),
        ("moeswap: expert slots device / host",
         f"{m['device_slots']} / {m['host_slots']} of {gib(m['slot_bytes'])}"),
        ("moeswap: experts resident", f"{m['experts_resident']} of {m['experts_total']}"),
        ("moeswap: experts left on disk", gib(m["experts_on_disk_bytes"])),
        ("moeswap: expected hit rate", f"{m['hit_rate']['total']:.1%} "
                                       f"(device {m['hit_rate']['device']:.1%})"),
        ("moeswap: predicted decode", f"{m['decode_tokens_per_second']:.2f} tokens/s"),
        ("moeswap: predicted prefill", f"{m['prefill_tokens_per_second']:.1f} tokens/s"),
        ("llama.cpp: GPU / CPU weights", f"{gib(llama['gpu_bytes'])} / {gib(llama['cpu_bytes'])}"),
        ("llama.cpp: predicted decode", f"{llama['decode_tokens_per_second']:.2f} tokens/s"),
    ]
    budget = doc["budget"]
    title = (f"{doc['model']} ({doc['architecture']}): ctx {budget['context']} x "
             f"{budget['batch']}, device {gib(budget['device_bytes'])}, host "
             f"{gib(budget['host_bytes'])}")
    lines = [title, "", "| | |", "|---|---:|", *(f"| {what} | {value} |" for what, value in rows), "",
             f"hit rate: {m['hit_rate']['source']}; rates: {m['rates']['source']}", "",
             f"- moeswap: `{shlex.join(m['command'])}`",
             f"- llama.cpp: `{shlex.join(llama['command'])}`",
             *(f"  - note: {note}" for note in llama["notes"]),
             f"- Ollama: `{doc['ollama']['modelfile'].strip().replace(chr(10), '; ')}`",
             *(f"  - note: {note}" for note in doc["ollama"]["notes"])]
    if "multi_gpu" in doc:
        g = doc["multi_gpu"]
        lines += [f"- {g['gpus']} GPUs, vLLM: `{shlex.join(g['vllm'])}`",
                  f"- {g['gpus']} GPUs, SGLang: `{shlex.join(g['sglang'])}`",
                  *(f"  - note: {note}" for note in g["notes"])]
    return lines
