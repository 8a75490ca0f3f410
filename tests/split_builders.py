"""Copies of a GGUF file written by gguf-py's ``GGUFWriter``: as a split set, with tensors
stored in another type, or both. The writer is llama.cpp's own Python package, independent of
moeswap's reader and of ``moeswap fix``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType as T, GGUFWriter
from gguf_builders import ALL_LAYOUTS, D, V, ModelSpec, Mutation, replace_once

# (name, values [rows, in] float32 or None when the tensor is not float) -> (array, type) or
# None to copy the stored bytes unchanged.
Restore = Callable[[str, np.ndarray], "tuple[np.ndarray, Q] | None"]
FLOAT_TYPES = (Q.F32, Q.F16)


def rewrite(source, path, *, split_max_tensors: int = 0, restore: Restore | None = None) -> Path:
    """Copy ``source`` to ``path`` (or to ``path.stem-0000i-of-0000N.gguf`` when
    ``split_max_tensors`` cuts it into pieces); returns the first file written."""
    path = Path(path)
    reader = GGUFReader(source)
    writer = GGUFWriter(path, reader.fields["general.architecture"].contents(),
                        split_max_tensors=split_max_tensors)
    for f in reader.fields.values():
        if f.name.startswith(("GGUF.", "split.")) or f.name == "general.architecture":
            continue
        item_type = f.types[1] if len(f.types) > 1 else None
        writer.add_key_value(f.name, f.contents(), f.types[0], item_type)
    for t in reader.tensors:
        data = np.asarray(t.data)
        stored = None
        if restore is not None and t.tensor_type in FLOAT_TYPES:
            rows = data.reshape(-1, int(t.shape[0])).astype(np.float32)  # [rows, in]
            stored = restore(t.name, rows)
        if stored is None:
            writer.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
        else:
            array, qtype = stored
            shape = tuple(int(n) for n in reversed(t.shape))  # numpy order, expert index first
            writer.add_tensor(t.name, np.ascontiguousarray(array).reshape(*shape[:-1], -1),
                              raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    count = len(writer.tensors)
    writer.close()
    return path if count == 1 else path.with_name(f"{path.stem}-00001-of-{count:05d}.gguf")


def split_copy(source, path, pieces: int) -> Path:
    """``source`` as a split set of ``pieces`` files; returns the first piece's path."""
    n_tensors = len(GGUFReader(source).tensors)
    return rewrite(source, path, split_max_tensors=-(-n_tensors // pieces))


class SplitMutation(Mutation):
    """A broken split set: the layout written as ``pieces`` files by gguf-py's writer, then
    ``bytes`` applied to the first piece's path (it finds the others by name)."""

    pieces = 3

    def build(self, directory: Path) -> Path:
        spec = ALL_LAYOUTS[self.layout]()
        if self.spec:
            self.spec(spec)
        single = spec.write(directory / f"{self.name}.single.gguf")
        first = split_copy(single, directory / f"{self.name}.gguf", self.pieces)
        single.unlink()
        if self.bytes:
            self.bytes(first)
        return first


def piece(first: Path, number: int) -> Path:
    """Piece ``number`` (1-based) of the set whose first piece is ``first``."""
    return first.with_name(first.name.replace("-00001-of-", f"-{number:05d}-of-"))


def _tensor_in_last_piece(spec: ModelSpec) -> None:
    spec.add("tokenXembd.weight", (D, V))  # renamed to token_embd (piece 1) after writing


def _differing_key(spec: ModelSpec) -> None:
    spec.kv["general.xyzabcdefgh"] = (5, T.INT32)  # as long as split.tensors.count


def _count_plus_one(first: Path) -> None:
    data = bytearray(first.read_bytes())
    key = b"split.tensors.count"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4  # the i32 value
    data[at:at + 4] = struct.pack("<i", struct.unpack_from("<i", data, at)[0] + 1)
    first.write_bytes(bytes(data))


SPLIT_MUTATIONS: tuple[Mutation, ...] = (
    SplitMutation("split_piece_missing", "qwen3moe", frozenset({"split-piece-missing"}), False,
                  bytes=lambda p: piece(p, 2).unlink()),
    SplitMutation("split_piece_mismatch", "qwen3moe", frozenset({"split-piece-mismatch"}), False,
                  bytes=lambda p: piece(p, 2).write_bytes(piece(p, 3).read_bytes())),
    SplitMutation("split_duplicate_tensor", "qwen3moe", frozenset({"duplicate-tensor"}), False,
                  spec=_tensor_in_last_piece,
                  bytes=lambda p: replace_once(piece(p, 3), b"tokenXembd.weight",
                                               b"token_embd.weight")),
    SplitMutation("split_tensor_count", "qwen3moe", frozenset({"split-tensor-count"}), True,
                  bytes=_count_plus_one),
    SplitMutation("split_key_differs", "qwen3moe", frozenset({"split-key-differs"}), True,
                  spec=_differing_key,
                  bytes=lambda p: replace_once(piece(p, 2), b"split.tensors.count",
                                               b"general.xyzabcdefgh")),
)
