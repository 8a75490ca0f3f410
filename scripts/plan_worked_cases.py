"""The seeds' two worked cases as plans, from GGUF headers of the real published shapes.

    python scripts/plan_worked_cases.py [--work-dir .bench]

Writes two header-only GGUF files whose tensor data is a sparse hole (the planner reads only
the header and tensor index), with llama.cpp's tensor names and an approximation of its Q4_K_M
type mix (Q4_K; Q6_K for ffn_down / attn_v on llama.cpp's "more bits" layers and the output
head; rows not a multiple of 256 fall back to Q5_0 / Q8_0 as llama.cpp does; norms, routers
and scales F32), then prints ``moeswap plan`` for:

- DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers, n_embd 2048, 16 heads,
  MLA with kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128, no q_lora; 64 routed experts of
  width 1408 + 2 shared, top-6, first layer dense of width 10944; vocabulary 102400) on a 12 GB
  GPU with 32 GB RAM, 8192 context;
- Gemma-4-26B-A4B (google/gemma-4-26B-A4B text_config: 30 layers, n_embd 2816, 16 heads;
  sliding layers 8 kv heads of 256 with a 1024 window, every 6th layer global with 2 kv heads of
  512 and keys reused as values; 128 experts of width 704, top-8, a dense GeGLU FFN of 2112
  beside them; vocabulary 262144, tied head) on a 24 GB GPU with 32 GB RAM, 32768 context.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parent.parent
# GB/s of the machine the seeds describe, not this one: a consumer GPU's product over quantized
# bytes, PCIe 4.0 x16 as used, dual-channel DDR5 through the CPU kernels, an NVMe Gen4 SSD.
ASSUMED_RATES = ["--gpu-bw", "400", "--link-bw", "25", "--ram-bw", "60", "--disk-bw", "7"]


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".bench")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    deepseek = deepseek_v2_lite(args.work_dir / "deepseek-v2-lite-q4_k_m.header.gguf")
    gemma = gemma4_26b(args.work_dir / "gemma-4-26b-a4b-q4_k_m.header.gguf")
    cases = [(deepseek, ["--device-mem", "12GB", "--host-mem", "32GB", "--ctx", "8192"]),
             (deepseek, ["--device-mem", "6GB", "--host-mem", "32GB", "--ctx", "8192"]),
             (gemma, ["--device-mem", "24GB", "--host-mem", "32GB", "--ctx", "32768"]),
             (gemma, ["--device-mem", "24GB", "--host-mem", "32GB", "--ctx", "32768",
                      "--gpus", "2", "--gpu-mem", "16GB"])]
    for path, flags in cases:
        flags = [*flags, *ASSUMED_RATES]
        print(f"$ moeswap plan {path.name} {' '.join(flags)}", flush=True)
        subprocess.run([sys.executable, "-m", "moeswap", "plan", str(path), *flags], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
