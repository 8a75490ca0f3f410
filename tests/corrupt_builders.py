"""Damaged copies of the built-in model (moeswap/data/stdlib-moe-q8_0.gguf): each CORRUPTIONS
entry breaks it one way issue 23 found `run` crashing on, computing nonsense from, or doctor
calling clean, and names the doctor rules that must catch it.

Two ways to break a file: ``rebuild`` writes it again with gguf.GGUFWriter from edited keys
and tensors; the byte patches (``set_u32`` and gguf_builders' ``patch_tensor_info``) change one
field of the written header in place.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType as T, GGUFWriter
from gguf_builders import patch_tensor_info, replace_once, tensor_info_offset

import moeswap

BUILT_IN = Path(moeswap.DEFAULT_MODEL)
A = "llama"  # the built-in model's architecture


@dataclass
class Contents:
    """The built-in model as editable keys {name: (value, type, item type)} and tensors
    {name: (stored array, ggml type)}, in file order."""

    kv: dict[str, tuple]
    tensors: dict[str, tuple[np.ndarray, Q]]


def read_built_in() -> Contents:
    reader = GGUFReader(BUILT_IN)
    kv = {}
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        kv[f.name] = (f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    return Contents(kv, tensors)


def write(contents: Contents, path: Path) -> Path:
    writer = GGUFWriter(path, contents.kv["general.architecture"][0])
    for key, (value, vtype, item_type) in contents.kv.items():
        if key != "general.architecture":
            writer.add_key_value(key, value, vtype, item_type)
    for name, (array, qtype) in contents.tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def set_u32(path: Path, key: str, value: int) -> None:
    """Overwrite the u32 value of ``key`` in the written file."""
    data = bytearray(path.read_bytes())
    record = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", T.UINT32)
    at = data.index(record) + len(record)
    struct.pack_into("<I", data, at, value)
    path.write_bytes(bytes(data))


def set_f32(path: Path, key: str, value: float) -> None:
    data = bytearray(path.read_bytes())
    record = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", T.FLOAT32)
    struct.pack_into("<f", data, data.index(record) + len(record), value)
    path.write_bytes(bytes(data))


# --- edits of the contents ----------------------------------------------------------------

def _key(name: str, value, vtype=T.UINT32, item_type=None):
    def edit(c: Contents) -> None:
        c.kv[name] = (value, vtype, item_type)
    return edit


def _drop_key(name: str):
    return lambda c: c.kv.pop(name)


def _drop_tensor(name: str):
    return lambda c: c.tensors.pop(name)


def _tokens(count: int):
    def edit(c: Contents) -> None:
        tokens = c.kv["tokenizer.ggml.tokens"][0][:count]
        c.kv["tokenizer.ggml.tokens"] = (tokens, T.ARRAY, T.STRING)
        c.kv["tokenizer.ggml.token_type"] = (c.kv["tokenizer.ggml.token_type"][0][:count],
                                             T.ARRAY, T.INT32)
    return edit


def _poison(name: str, value: float, at: int = 3):
    def edit(c: Contents) -> None:
        array, qtype = c.tensors[name]
        array = array.copy()
        array.reshape(-1)[at] = value
        c.tensors[name] = (array, qtype)
    return edit


def _retype_experts(qtype: Q):
    """blk.0's gate experts stored as ``qtype`` while the header keeps saying Q8_0: the
    recorded offsets stay, so the data range shrinks (a gap) or grows (an overlap)."""
    def patch(path: Path) -> None:
        patch_tensor_info(path, "blk.0.ffn_gate_exps.weight", type_id=int(qtype))
    return patch


def _same_offset(path: Path) -> None:
    """blk.0.attn_norm's offset set to blk.0.ffn_norm's: two tensors at one offset."""
    reader = GGUFReader(path)
    offsets = {t.name: int(t.data_offset) - reader.data_offset for t in reader.tensors}
    delta = offsets["blk.0.ffn_norm.weight"] - offsets["blk.0.attn_norm.weight"]
    patch_tensor_info(path, "blk.0.attn_norm.weight", offset_delta=delta)


def _swap_dims(name: str):
    """``name``'s two dimensions swapped: the same bytes, a shape the model cannot use."""
    def patch(path: Path) -> None:
        data = bytearray(path.read_bytes())
        at = tensor_info_offset(bytes(data), name) + 4
        ne = struct.unpack_from("<QQ", data, at)
        struct.pack_into("<QQ", data, at, ne[1], ne[0])
        path.write_bytes(bytes(data))
    return patch


def _non_utf8_token(path: Path) -> None:
    replace_once(path, struct.pack("<Q", 6) + b"return", struct.pack("<Q", 6) + b"\xffeturn")


def _duplicate_key(c: Contents) -> None:
    c.kv["general.dup_a"] = ("x", T.STRING, None)
    c.kv["general.dup_b"] = ("y", T.STRING, None)


def _duplicate_tensor(c: Contents) -> None:
    c.tensors["blk.0.attn_z.weight"] = c.tensors["blk.0.attn_q.weight"]


@dataclass(frozen=True)
class Corruption:
    name: str
    rules: frozenset[str]  # doctor must report at least these (all errors)
    edit: Callable[[Contents], None] | None = None
    patch: Callable[[Path], None] | None = None

    def build(self, directory: Path, contents: Contents) -> Path:
        edited = Contents(dict(contents.kv), dict(contents.tensors))
        if self.edit:
            self.edit(edited)
        path = write(edited, directory / f"{self.name}.gguf")
        if self.patch:
            self.patch(path)
        return path


R = frozenset
CORRUPTIONS: tuple[Corruption, ...] = (
    # run crashed (ggml assert, tracebacks, MemoryError)
    Corruption("expert_dim_zero", R({"invalid-tensor-shape"}),
               patch=lambda p: patch_tensor_info(p, "blk.0.ffn_gate_exps.weight", ne0=0)),
    Corruption("head_count_zero", R({"bad-hyperparameter"}),
               patch=lambda p: set_u32(p, f"{A}.attention.head_count", 0)),
    Corruption("head_count_three", R({"bad-hyperparameter"}),
               patch=lambda p: set_u32(p, f"{A}.attention.head_count", 3)),
    Corruption("head_count_kv_not_dividing", R({"bad-hyperparameter"}),
               patch=lambda p: set_u32(p, f"{A}.attention.head_count_kv", 3)),
    Corruption("rope_wider_than_head", R({"bad-hyperparameter"}),
               patch=lambda p: set_u32(p, f"{A}.rope.dimension_count", 64)),
    Corruption("expert_used_zero", R({"expert-used-zero"}),
               patch=lambda p: set_u32(p, f"{A}.expert_used_count", 0)),
    Corruption("expert_used_17", R({"expert-used-gt-count"}),
               patch=lambda p: set_u32(p, f"{A}.expert_used_count", 17)),
    Corruption("expert_used_2_63", R({"wrong-key-type"}),
               edit=_key(f"{A}.expert_used_count", 1 << 63, T.UINT64)),
    Corruption("expert_used_missing", R({"missing-expert-used-count"}),
               edit=_drop_key(f"{A}.expert_used_count")),
    Corruption("expert_count_array", R({"wrong-key-type"}),
               edit=_key(f"{A}.expert_count", [16] * 6, T.ARRAY, T.UINT32)),
    Corruption("per_layer_array_short", R({"per-layer-array-length"}),
               edit=_key(f"{A}.attention.head_count", [8] * 5, T.ARRAY, T.UINT32)),
    Corruption("chat_template_u32", R({"bad-tokenizer"}),
               edit=_key("tokenizer.chat_template", 7)),
    Corruption("vocabulary_missing", R({"bad-tokenizer"}),
               edit=_drop_key("tokenizer.ggml.tokens")),  # GGUFWriter writes no empty array
    Corruption("vocabulary_100", R({"bad-tokenizer"}), edit=_tokens(100)),
    Corruption("token_not_utf8", R({"bad-tokenizer"}), patch=_non_utf8_token),
    Corruption("tokenizer_model_unknown", R({"bad-tokenizer"}),
               edit=_key("tokenizer.ggml.model", "wordpiece-x", T.STRING)),
    Corruption("block_count_2_31", R({"missing-layer"}),
               patch=lambda p: set_u32(p, f"{A}.block_count", 1 << 31)),
    # run computed nonsense and exited 0
    Corruption("expert_retyped_q4_0", R({"tensor-size-mismatch"}), patch=_retype_experts(Q.Q4_0)),
    Corruption("expert_retyped_f32", R({"tensor-data-overlap"}), patch=_retype_experts(Q.F32)),
    Corruption("two_tensors_one_offset", R({"tensor-data-overlap"}), patch=_same_offset),
    Corruption("nan_in_router", R({"non-finite-values"}),
               edit=_poison("blk.2.ffn_gate_inp.weight", float("nan"))),
    Corruption("inf_in_norm", R({"non-finite-values"}),
               edit=_poison("output_norm.weight", float("inf"))),
    Corruption("rope_base_zero", R({"bad-hyperparameter"}),
               patch=lambda p: set_f32(p, f"{A}.rope.freq_base", 0.0)),
    Corruption("rope_base_nan", R({"bad-hyperparameter"}),
               patch=lambda p: set_f32(p, f"{A}.rope.freq_base", float("nan"))),
    Corruption("block_count_zero", R({"missing-layer"}),
               patch=lambda p: set_u32(p, f"{A}.block_count", 0)),
    Corruption("block_count_five", R({"missing-layer"}),
               patch=lambda p: set_u32(p, f"{A}.block_count", 5)),
    Corruption("misaligned_offset", R({"misaligned-tensor-offset"}),
               patch=lambda p: patch_tensor_info(p, "blk.3.attn_q.weight", offset_delta=4)),
    Corruption("duplicate_key", R({"duplicate-key"}), edit=_duplicate_key,
               patch=lambda p: replace_once(p, b"general.dup_b", b"general.dup_a")),
    Corruption("duplicate_tensor", R({"duplicate-tensor"}), edit=_duplicate_tensor,
               patch=lambda p: replace_once(p, b"blk.0.attn_z.weight", b"blk.0.attn_q.weight")),
    # doctor called these clean
    Corruption("no_token_embd", R({"missing-tensor"}), edit=_drop_tensor("token_embd.weight")),
    Corruption("no_output_norm", R({"missing-tensor"}), edit=_drop_tensor("output_norm.weight")),
    Corruption("no_attention_k", R({"missing-tensor"}), edit=_drop_tensor("blk.4.attn_k.weight")),
    # run refused these at load, doctor called them clean
    Corruption("attn_k_dims_swapped", R({"tensor-shape-mismatch"}),
               patch=_swap_dims("blk.1.attn_k.weight")),
)
