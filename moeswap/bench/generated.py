"""Generated benchmark models: a Mixtral-shaped Q8_0 GGUF with random weights (8 experts, top-2,
GQA 4:1, ff = 3.5 x width), grown layer by layer to a target file size, and its Q4_K_M copy
requantized by llama.cpp. Files are written once into a work folder under a temporary name,
renamed when complete, so a shared folder never holds a half-written model."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from moeswap.errors import MoeswapError


def mixtral_shape(target_gb: float, tiny: bool) -> dict:
    """Mixtral's proportions (8 experts, top-2, GQA 4:1, ff = 3.5 x width) at a width this
    machine can run; layers are added until the file reaches target_gb."""
    shape = dict(n_embd=1024, n_ff=3584, n_head=8, n_head_kv=2, n_expert=8, n_used=2, vocab=32000)
    if tiny:
        shape.update(n_embd=128, n_ff=448, n_head=4, n_head_kv=1, vocab=512)
    e, f, x, v = shape["n_embd"], shape["n_ff"], shape["n_expert"], shape["vocab"]
    head_dim = e // shape["n_head"]
    q8 = 34 / 32  # Q8_0: 34 bytes per 32 weights
    per_layer = q8 * (3 * e * f * x + 2 * e * e + 2 * e * shape["n_head_kv"] * head_dim)
    shape["n_layer"] = max(1, math.ceil((target_gb * 1e9 - q8 * 2 * v * e) / per_layer))
    return shape


def q8_0_random(rng: np.random.Generator, n_rows: int, n_cols: int, scale: float) -> np.ndarray:
    """Random Q8_0 bytes for a [n_rows, n_cols] matrix: int8 quants, one fp16 scale per block."""
    blocks = np.empty((n_rows, n_cols // 32), dtype=[("d", "<f2"), ("qs", "i1", 32)])
    blocks["d"] = np.float16(scale)
    blocks["qs"] = rng.integers(-127, 128, size=(n_rows, n_cols // 32, 32), dtype=np.int8)
    return blocks.view(np.uint8).reshape(n_rows, -1)


def write_mixtral(path: Path, shape: dict, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    e, f, x, v = shape["n_embd"], shape["n_ff"], shape["n_expert"], shape["vocab"]
    head_dim = e // shape["n_head"]
    kv = shape["n_head_kv"] * head_dim
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("bench-mixtral-shaped-q8_0")
    writer.add_context_length(4096)
    writer.add_embedding_length(e)
    writer.add_block_count(shape["n_layer"])
    writer.add_feed_forward_length(f)
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(shape["n_head"])
    writer.add_head_count_kv(shape["n_head_kv"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(1e6)
    writer.add_expert_count(x)
    writer.add_expert_used_count(shape["n_used"])
    writer.add_vocab_size(v)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"▁w{i}" for i in range(v - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(v - 259)])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (v - 259))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    # (name, numpy-order shape [outer..., rows, cols], kind); weights are made as written.
    plan = [("token_embd.weight", (v, e), "q8"), ("output_norm.weight", (e,), "norm"),
            ("output.weight", (v, e), "q8")]
    for i in range(shape["n_layer"]):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (e,), "norm"), (p + "attn_q.weight", (e, e), "q8"),
                 (p + "attn_k.weight", (kv, e), "q8"), (p + "attn_v.weight", (kv, e), "q8"),
                 (p + "attn_output.weight", (e, e), "q8"), (p + "ffn_norm.weight", (e,), "norm"),
                 (p + "ffn_gate_inp.weight", (x, e), "router"),
                 (p + "ffn_gate_exps.weight", (x, f, e), "q8"),
                 (p + "ffn_up_exps.weight", (x, f, e), "q8"),
                 (p + "ffn_down_exps.weight", (x, e, f), "q8")]
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, dims, kind in plan:
        if kind == "q8":
            byte_shape = (*dims[:-1], dims[-1] // 32 * 34)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), q8)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in plan:
        if kind == "q8":
            rows = int(np.prod(dims[:-1]))
            # ~unit-variance outputs for unit-variance inputs: quant std 73 x scale x sqrt(cols)
            data = q8_0_random(rng, rows, dims[-1], 1.0 / (73 * math.sqrt(dims[-1])))
            writer.write_tensor_data(data.reshape(*dims[:-1], -1))
        elif kind == "norm":
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data(rng.standard_normal(dims).astype(np.float32))
    writer.close()


def cached_model(work_dir: Path, name: str, shape: dict) -> Path:
    """``work_dir/name``, written from ``shape`` unless it is there already."""
    path = work_dir / name
    if not path.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # unique: shared folder
        write_mixtral(partial, shape)
        partial.rename(path)
    return path


def mixtral_of_size(work_dir: Path, gb: float) -> Path:
    """The generated model of about ``gb`` GB (offload, prefetch and plan suites' name for it)."""
    return cached_model(work_dir, f"mixtral-shaped-{gb:g}gb-q8_0.gguf", mixtral_shape(gb, tiny=False))


def q4_k_m_copy(source: Path) -> Path:
    """``source`` requantized to Q4_K_M beside it (written once)."""
    target = source.with_name(source.name.replace("q8_0", "q4_k_m"))
    if not target.exists():
        requantize_q4_k_m(source, target)
    return target


def requantize_q4_k_m(source: Path, target: Path) -> None:
    """K-quants come from llama.cpp's own quantizer (the gguf package cannot write them)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    partial = target.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
        raise MoeswapError(f"llama.cpp could not quantize {source} to Q4_K_M")
    partial.replace(target)
