"""Tiny MoE GGUF files built with gguf.GGUFWriter, and a catalogue of broken variants.

Four layouts with real architectures' tensor names at toy sizes: Mixtral (arch `llama`),
Qwen3-MoE, DeepSeek2 (shared experts, a leading dense layer, MLA) and Gemma4 (fused gate_up
experts, scales, dense FFN beside the MoE, tied output). Each `MUTATIONS` entry breaks one
rule, either in the spec before writing or in the bytes after.
Shapes are GGUF `ne` order: D n_embd, F expert width, E experts, V vocabulary.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFValueType as T, GGUFWriter
from gguf.quants import quantize

D, F, V = 64, 32, 32  # n_embd, expert width, vocabulary


@dataclass
class TensorSpec:
    name: str
    ne: tuple[int, ...]
    type: Q
    data: bytes


@dataclass
class ModelSpec:
    arch: str
    kv: dict[str, tuple] = field(default_factory=dict)  # key -> (value, type[, item type])
    tensors: list[TensorSpec] = field(default_factory=list)

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def add(self, name: str, ne: tuple[int, ...], qtype: Q = Q.F32) -> None:
        self.tensors.append(TensorSpec(name, ne, qtype, make_bytes(name, ne, qtype)))

    def drop_tensors(self, predicate: Callable[[str], bool]) -> None:
        self.tensors = [t for t in self.tensors if not predicate(t.name)]

    def rename(self, old: str, new: str) -> None:
        for t in self.tensors:
            if old in t.name:
                t.name = t.name.replace(old, new)

    def write(self, path: Path) -> Path:
        writer = GGUFWriter(path, self.arch)
        for key, (value, vtype, *item_type) in self.kv.items():
            if key != "general.architecture":
                writer.add_key_value(key, value, vtype, item_type[0] if item_type else None)
        for t in self.tensors:
            block, type_size = GGML_QUANT_SIZES[t.type]
            byte_shape = (*reversed(t.ne[1:]), t.ne[0] // block * type_size)
            writer.add_tensor(t.name, np.frombuffer(t.data, np.uint8).reshape(byte_shape),
                              raw_dtype=t.type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


def make_bytes(name: str, ne: tuple[int, ...], qtype: Q) -> bytes:
    """Deterministic small values for one tensor, stored as `qtype`."""
    rng = np.random.default_rng(sum(name.encode()) * 7919 + len(name))
    values = (rng.standard_normal(tuple(reversed(ne))) * 0.02).astype(np.float32)
    if qtype == Q.F32:
        return values.tobytes()
    if qtype == Q.F16:
        return values.astype(np.float16).tobytes()
    return quantize(values, qtype).tobytes()


def _u32(value: int) -> tuple:
    return (value, T.UINT32)


def _tokenizer(spec: ModelSpec) -> None:
    """A minimal SentencePiece-style vocabulary llama.cpp accepts."""
    tokens = ["<unk>", "<s>", "</s>", "<0x0A>"] + [chr(ord("a") + i) for i in range(V - 4)]
    types = [2, 3, 3, 6] + [1] * (V - 4)
    spec.kv.update({
        "tokenizer.ggml.model": ("llama", T.STRING),
        "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
        "tokenizer.ggml.scores": ([float(-i) for i in range(V)], T.ARRAY, T.FLOAT32),
        "tokenizer.ggml.token_type": (types, T.ARRAY, T.INT32),
        "tokenizer.ggml.bos_token_id": _u32(1),
        "tokenizer.ggml.eos_token_id": _u32(2),
        "tokenizer.ggml.unknown_token_id": _u32(0),
    })


def _attention(spec: ModelSpec, layer: int, qk_norm: bool = False) -> None:
    p = f"blk.{layer}."
    spec.add(p + "attn_norm.weight", (D,))
    spec.add(p + "attn_q.weight", (D, D))
    spec.add(p + "attn_k.weight", (D, 32))
    spec.add(p + "attn_v.weight", (D, 32))
    spec.add(p + "attn_output.weight", (D, D))
    if qk_norm:
        spec.add(p + "attn_q_norm.weight", (16,))
        spec.add(p + "attn_k_norm.weight", (16,))


def _base(arch: str, n_layers: int, n_expert: int, n_used: int) -> ModelSpec:
    spec = ModelSpec(arch)
    spec.kv.update({
        "general.architecture": (arch, T.STRING),
        spec.key("context_length"): _u32(128),
        spec.key("embedding_length"): _u32(D),
        spec.key("block_count"): _u32(n_layers),
        spec.key("attention.head_count"): _u32(4),
        spec.key("attention.head_count_kv"): _u32(2),
        spec.key("attention.layer_norm_rms_epsilon"): (1e-5, T.FLOAT32),
        spec.key("expert_count"): _u32(n_expert),
        spec.key("expert_used_count"): _u32(n_used),
    })
    _tokenizer(spec)
    spec.add("token_embd.weight", (D, V))
    return spec


def _routed(spec: ModelSpec, layer: int, n_expert: int, qtype: Q) -> None:
    p = f"blk.{layer}."
    spec.add(p + "ffn_norm.weight", (D,))
    spec.add(p + "ffn_gate_inp.weight", (D, n_expert))  # router {D, E}, kept F32
    spec.add(p + "ffn_gate_exps.weight", (D, F, n_expert), qtype)
    spec.add(p + "ffn_up_exps.weight", (D, F, n_expert), qtype)
    spec.add(p + "ffn_down_exps.weight", (F, D, n_expert), qtype)


def _head(spec: ModelSpec, tied: bool = False) -> None:
    spec.add("output_norm.weight", (D,))
    if not tied:
        spec.add("output.weight", (D, V))


def mixtral() -> ModelSpec:
    """Mixtral layout: arch `llama`, 4 experts top-2, F32 (loadable by llama.cpp)."""
    spec = _base("llama", 2, 4, 2)
    spec.kv[spec.key("feed_forward_length")] = _u32(F)
    spec.kv[spec.key("rope.dimension_count")] = _u32(16)
    for layer in range(2):
        _attention(spec, layer)
        _routed(spec, layer, 4, Q.F32)
    _head(spec)
    return spec


def mixtral_legacy() -> ModelSpec:
    """The same model with experts as legacy per-expert tensors blk.N.ffn_{gate,up,down}.E."""
    spec = mixtral()
    stacked = {t.name: t for t in spec.tensors if "_exps" in t.name}
    tensors = []
    for t in spec.tensors:
        if t.name not in stacked:
            tensors.append(t)
            continue
        layer_prefix, base, _ = t.name.rsplit(".", 2)
        part = base.removeprefix("ffn_").removesuffix("_exps")
        per_expert = len(t.data) // t.ne[2]
        for e in range(t.ne[2]):
            tensors.append(TensorSpec(f"{layer_prefix}.ffn_{part}.{e}.weight", t.ne[:2], t.type,
                                      t.data[e * per_expert:(e + 1) * per_expert]))
    spec.tensors = tensors
    return spec


def qwen3moe() -> ModelSpec:
    """Qwen3-MoE layout: 8 experts top-2, Q8_0 experts, q/k norms."""
    spec = _base("qwen3moe", 2, 8, 2)
    spec.kv[spec.key("expert_feed_forward_length")] = _u32(F)
    spec.kv[spec.key("attention.key_length")] = _u32(16)
    for layer in range(2):
        _attention(spec, layer, qk_norm=True)
        _routed(spec, layer, 8, Q.Q8_0)
    _head(spec)
    return spec


def deepseek2() -> ModelSpec:
    """DeepSeek2 layout: layer 0 dense, 8 routed + 2 shared experts, sigmoid gating, MLA."""
    spec = _base("deepseek2", 3, 8, 2)
    spec.kv.update({
        spec.key("expert_feed_forward_length"): _u32(F),
        spec.key("expert_shared_count"): _u32(2),
        spec.key("leading_dense_block_count"): _u32(1),
        spec.key("feed_forward_length"): _u32(96),
        spec.key("expert_gating_func"): _u32(2),
        spec.key("expert_weights_scale"): (2.5, T.FLOAT32),
        spec.key("expert_weights_norm"): (True, T.BOOL),
        # llama.cpp reads the MLA sizes from these (q_lora_rank 0: a plain attn_q, as in Lite);
        # heads of 24 = 16 without rope + 8 with, values of 16.
        spec.key("attention.kv_lora_rank"): _u32(16),
        spec.key("attention.q_lora_rank"): _u32(0),
        spec.key("attention.key_length"): _u32(24),
        spec.key("attention.value_length"): _u32(16),
        spec.key("rope.dimension_count"): _u32(8),
        spec.key("attention.head_count_kv"): _u32(4),
    })
    for layer in range(3):
        p = f"blk.{layer}."
        spec.add(p + "attn_norm.weight", (D,))
        spec.add(p + "attn_q.weight", (D, 96))
        spec.add(p + "attn_kv_a_mqa.weight", (D, 24))
        spec.add(p + "attn_kv_a_norm.weight", (16,))
        spec.add(p + "attn_kv_b.weight", (16, 128))
        spec.add(p + "attn_output.weight", (D, D))
        if layer == 0:
            spec.add(p + "ffn_norm.weight", (D,))
            spec.add(p + "ffn_gate.weight", (D, 96))
            spec.add(p + "ffn_up.weight", (D, 96))
            spec.add(p + "ffn_down.weight", (96, D))
            continue
        _routed(spec, layer, 8, Q.Q8_0)
        spec.add(p + "exp_probs_b.bias", (8,))
        spec.add(p + "ffn_gate_shexp.weight", (D, 2 * F))
        spec.add(p + "ffn_up_shexp.weight", (D, 2 * F))
        spec.add(p + "ffn_down_shexp.weight", (2 * F, D))
    _head(spec)
    return spec


def gemma4() -> ModelSpec:
    """Gemma4 layout: fused gate_up experts with scales, a dense FFN beside the MoE, tied output."""
    spec = _base("gemma4", 2, 4, 2)
    spec.kv[spec.key("expert_feed_forward_length")] = _u32(F)
    spec.kv[spec.key("feed_forward_length")] = _u32(48)
    # What llama.cpp's gemma4 loader demands: layer 0 sliding-window, layer 1 global, heads of
    # 16 in both, no per-layer embeddings.
    spec.kv.update({
        spec.key("attention.sliding_window_pattern"): ([True, False], T.ARRAY, T.BOOL),
        spec.key("attention.sliding_window"): _u32(8),
        spec.key("attention.key_length"): _u32(16),
        spec.key("attention.value_length"): _u32(16),
        spec.key("attention.key_length_swa"): _u32(16),
        spec.key("attention.value_length_swa"): _u32(16),
        spec.key("embedding_length_per_layer_input"): _u32(0),
    })
    spec.add("rope_freqs.weight", (8,))
    for layer in range(2):
        p = f"blk.{layer}."
        _attention(spec, layer, qk_norm=True)
        spec.add(p + "post_attention_norm.weight", (D,))
        spec.add(p + "ffn_norm.weight", (D,))
        spec.add(p + "post_ffw_norm.weight", (D,))
        spec.add(p + "ffn_gate.weight", (D, 48))
        spec.add(p + "ffn_up.weight", (D, 48))
        spec.add(p + "ffn_down.weight", (48, D))
        spec.add(p + "pre_ffw_norm_2.weight", (D,))
        spec.add(p + "ffn_gate_inp.weight", (D, 4))
        spec.add(p + "ffn_gate_inp.scale", (D,))
        spec.add(p + "ffn_gate_up_exps.weight", (D, 2 * F, 4), Q.Q8_0)
        spec.add(p + "ffn_down_exps.weight", (F, D, 4), Q.Q8_0)
        spec.add(p + "ffn_down_exps.scale", (4,))
        spec.add(p + "post_ffw_norm_1.weight", (D,))
        spec.add(p + "post_ffw_norm_2.weight", (D,))
    _head(spec, tied=True)
    return spec


LAYOUTS: dict[str, Callable[[], ModelSpec]] = {
    "mixtral": mixtral, "qwen3moe": qwen3moe, "deepseek2": deepseek2, "gemma4": gemma4,
}
ALL_LAYOUTS = {**LAYOUTS, "mixtral_legacy": mixtral_legacy}


# --- byte-level surgery on written files ----------------------------------------------------

EXPERT_MATRICES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def rewrite_experts(source, path, stored: Callable[[int, np.ndarray], tuple[np.ndarray, Q]]):
    """Copy the GGUF ``source`` to ``path`` with every key and tensor, the expert stacks
    replaced by ``stored(kind, values)`` -> (array, type to store it as); kind indexes
    EXPERT_MATRICES (gate, up, down)."""
    from gguf import GGUFReader

    reader = GGUFReader(source)
    writer = GGUFWriter(path, reader.fields["general.architecture"].contents())
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        item_type = f.types[1] if len(f.types) > 1 else None
        writer.add_key_value(f.name, f.contents(), f.types[0], item_type)
    for t in reader.tensors:
        data = np.asarray(t.data)
        kind = next((i for i, m in enumerate(EXPERT_MATRICES) if t.name.endswith(m)), None)
        if kind is None:
            writer.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
        else:
            array, qtype = stored(kind, data)
            writer.add_tensor(t.name, np.ascontiguousarray(array), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_info_offset(data: bytes, name: str) -> int:
    """Byte offset of a tensor-info record's n_dims field."""
    encoded = name.encode()
    marker = struct.pack("<Q", len(encoded)) + encoded
    at = data.index(marker)
    return at + len(marker)


def patch_tensor_info(path: Path, name: str, *, type_id: int | None = None,
                      offset_delta: int = 0, ne0: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = tensor_info_offset(bytes(data), name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    if ne0 is not None:
        struct.pack_into("<Q", data, at + 4, ne0)
    type_at = at + 4 + 8 * n_dims
    if type_id is not None:
        struct.pack_into("<I", data, type_at, type_id)
    (offset,) = struct.unpack_from("<Q", data, type_at + 4)
    struct.pack_into("<Q", data, type_at + 4, offset + offset_delta)
    path.write_bytes(bytes(data))


def replace_once(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert len(old) == len(new) and data.count(old) >= 1
    path.write_bytes(data.replace(old, new, 1))


def patch_header(path: Path, fmt: str, at: int, value) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))


def truncate(path: Path, size: int) -> None:
    """Keep the first `size` bytes (negative: drop the last -size)."""
    path.write_bytes(path.read_bytes()[:size])


@dataclass(frozen=True)
class Mutation:
    """One broken file: `expected` are exactly the rule ids doctor must report; `repairable`
    says whether `fix` (with `fix_sets`) must repair it."""

    name: str
    layout: str
    expected: frozenset[str]
    repairable: bool
    spec: Callable[[ModelSpec], None] | None = None
    bytes: Callable[[Path], None] | None = None
    fix_sets: tuple[str, ...] = ()

    def build(self, directory: Path) -> Path:
        spec = ALL_LAYOUTS[self.layout]()
        if self.spec:
            self.spec(spec)
        path = spec.write(directory / f"{self.name}.gguf")
        if self.bytes:
            self.bytes(path)
        return path


def _drop_key(suffix: str):
    return lambda spec: spec.kv.pop(spec.key(suffix))


def _set_key(suffix: str, value, vtype=T.UINT32):
    def apply(spec):
        spec.kv[spec.key(suffix)] = (value, vtype)
    return apply


def _mixtral_as_arch(arch: str):
    def apply(spec):
        spec.arch = arch
        spec.kv = {k.replace("llama.", f"{arch}.", 1): v for k, v in spec.kv.items()}
        spec.kv["general.architecture"] = (arch, T.STRING)
    return apply


def _rename_all(pairs):
    def apply(spec):
        for old, new in pairs:
            spec.rename(old, new)
    return apply


def _retype_first_expert(spec: ModelSpec) -> None:
    t = next(t for t in spec.tensors if t.name == "blk.1.ffn_up.2.weight")
    t.type, t.data = Q.F16, make_bytes(t.name, t.ne, Q.F16)


def _duplicate_key(spec: ModelSpec) -> None:
    spec.kv["general.dup_a"] = ("x", T.STRING)
    spec.kv["general.dup_b"] = ("y", T.STRING)


def _duplicate_tensor(spec: ModelSpec) -> None:
    spec.add("blk.1.attn_z.weight", (D, D))  # renamed to blk.1.attn_q after writing


E = frozenset
MUTATIONS: tuple[Mutation, ...] = (
    Mutation("not_gguf", "qwen3moe", E({"not-gguf"}), False,
             bytes=lambda p: replace_once(p, b"GGUF", b"GGML")),
    Mutation("unsupported_version", "qwen3moe", E({"unsupported-version"}), False,
             bytes=lambda p: patch_header(p, "<I", 4, 7)),
    Mutation("header_truncated", "qwen3moe", E({"header-truncated"}), False,
             bytes=lambda p: truncate(p, 300)),
    Mutation("header_corrupt", "qwen3moe", E({"header-corrupt"}), False,
             bytes=lambda p: patch_header(p, "<Q", 16, 1 << 60)),
    Mutation("duplicate_key", "qwen3moe", E({"duplicate-key"}), False, spec=_duplicate_key,
             bytes=lambda p: replace_once(p, b"general.dup_b", b"general.dup_a")),
    Mutation("duplicate_tensor", "qwen3moe", E({"duplicate-tensor"}), False,
             spec=_duplicate_tensor,
             bytes=lambda p: replace_once(p, b"blk.1.attn_z.weight", b"blk.1.attn_q.weight")),
    Mutation("missing_architecture", "qwen3moe", E({"missing-architecture"}), False,
             bytes=lambda p: replace_once(p, b"general.architecture", b"general.architectur_")),
    Mutation("unknown_architecture", "mixtral", E({"unknown-architecture"}), False,
             spec=_mixtral_as_arch("mixtral")),
    Mutation("missing_required_key", "qwen3moe", E({"missing-required-key"}), False,
             spec=_drop_key("embedding_length")),
    Mutation("wrong_key_type_u64", "qwen3moe", E({"wrong-key-type"}), True,
             spec=_set_key("expert_count", 8, T.UINT64)),
    Mutation("wrong_key_type_i32", "deepseek2", E({"wrong-key-type"}), True,
             spec=_set_key("leading_dense_block_count", 1, T.INT32)),
    Mutation("missing_expert_count", "deepseek2", E({"missing-expert-count"}), True,
             spec=_drop_key("expert_count")),
    Mutation("missing_expert_used_count", "qwen3moe", E({"missing-expert-used-count"}), True,
             spec=_drop_key("expert_used_count"), fix_sets=("qwen3moe.expert_used_count=2",)),
    Mutation("missing_expert_ff_length", "gemma4", E({"missing-expert-feed-forward-length"}),
             True, spec=_drop_key("expert_feed_forward_length")),
    Mutation("expert_count_over_limit", "qwen3moe",
             E({"expert-count-over-limit", "expert-shape-mismatch"}), True,
             spec=_set_key("expert_count", 513), fix_sets=("qwen3moe.expert_count=8",)),
    Mutation("expert_used_zero", "mixtral", E({"expert-used-zero"}), True,
             spec=_set_key("expert_used_count", 0), fix_sets=("llama.expert_used_count=2",)),
    Mutation("expert_used_gt_count", "deepseek2", E({"expert-used-gt-count"}), True,
             spec=_set_key("expert_used_count", 9), fix_sets=("deepseek2.expert_used_count=6",)),
    Mutation("nonstandard_names", "qwen3moe", E({"nonstandard-expert-name"}), True,
             spec=_rename_all([("ffn_gate_exps", "ffn_gate_experts"),
                               ("ffn_up_exps", "ffn_up_experts"),
                               ("ffn_down_exps", "ffn_down_moe")])),
    Mutation("legacy_split", "mixtral_legacy", E({"legacy-split-experts"}), True),
    Mutation("mixed_expert_types", "mixtral_legacy",
             E({"legacy-split-experts", "mixed-expert-types"}), False, spec=_retype_first_expert),
    Mutation("missing_layer", "deepseek2", E({"missing-layer"}), False,
             spec=lambda s: s.drop_tensors(lambda n: n.startswith("blk.1."))),
    Mutation("missing_router", "gemma4", E({"missing-router"}), False,
             spec=lambda s: s.drop_tensors(lambda n: n == "blk.1.ffn_gate_inp.weight")),
    Mutation("expert_shape_mismatch", "qwen3moe", E({"expert-shape-mismatch"}), False,
             spec=_set_key("expert_feed_forward_length", 64)),
    Mutation("unknown_tensor_type", "qwen3moe", E({"unknown-tensor-type"}), False,
             bytes=lambda p: patch_tensor_info(p, "blk.0.attn_q.weight", type_id=200)),
    Mutation("invalid_tensor_shape", "qwen3moe",
             E({"invalid-tensor-shape", "expert-shape-mismatch"}), False,
             bytes=lambda p: patch_tensor_info(p, "blk.0.ffn_up_exps.weight", ne0=48)),
    Mutation("misaligned_offset", "mixtral", E({"misaligned-tensor-offset"}), True,
             bytes=lambda p: patch_tensor_info(p, "token_embd.weight", offset_delta=4)),
    Mutation("tensor_data_past_eof", "gemma4", E({"tensor-data-past-eof"}), False,
             bytes=lambda p: truncate(p, -100)),
)
