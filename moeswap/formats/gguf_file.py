"""A tolerant, lazy reader of a GGUF file's header and tensor index.

Why not ``gguf.GGUFReader``: it turns every element of every array into a numpy view in Python
(14.7 s for Gemma 3's 262k-token vocabulary here) and fails on damaged files with generic
exceptions. This reader walks the header once with ``struct`` over an mmap, keeps string
arrays as byte spans decoded on demand, and reports damage as ``GGUFFormatError`` with the
doctor rule it maps to. Tensor data is never touched; value types and quant sizes come from
the ``gguf`` package.

A split set (``NAME-00001-of-00005.gguf`` ..., keys ``split.no`` / ``split.count`` /
``split.tensors.count``, as llama.cpp's gguf-split and gguf-py's writer make them) opens as one
model from any of its pieces: metadata from the first piece (llama.cpp reads no other), the
tensors of every piece, each ``TensorInfo`` saying which piece holds its bytes.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from moeswap.errors import GGUFFormatError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
# llama.cpp's short names for value types, as its loader prints them.
TYPE_SHORT_NAMES = {
    GGUFValueType.UINT8: "u8", GGUFValueType.INT8: "i8", GGUFValueType.UINT16: "u16",
    GGUFValueType.INT16: "i16", GGUFValueType.UINT32: "u32", GGUFValueType.INT32: "i32",
    GGUFValueType.FLOAT32: "f32", GGUFValueType.BOOL: "bool", GGUFValueType.STRING: "str",
    GGUFValueType.ARRAY: "arr", GGUFValueType.UINT64: "u64", GGUFValueType.INT64: "i64",
    GGUFValueType.FLOAT64: "f64",
}


@dataclass(frozen=True)
class StringArray:
    """An array of strings kept as a byte span of the file; decoded only when iterated."""

    buffer: Any  # the file's mmap
    start: int
    count: int

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[str]:
        offset = self.start
        for _ in range(self.count):
            (length,) = struct.unpack_from("<Q", self.buffer, offset)
            yield bytes(self.buffer[offset + 8: offset + 8 + length]).decode("utf-8", "replace")
            offset += 8 + length

    def to_list(self) -> list[str]:
        return list(self)


@dataclass(frozen=True)
class KeyValue:
    key: str
    type: GGUFValueType
    value: Any  # int/float/bool/str; np.ndarray or StringArray for arrays
    item_type: GGUFValueType | None  # element type of an array
    start: int  # byte span of the whole record (key included) in the file
    end: int

    @property
    def type_name(self) -> str:
        if self.type == GGUFValueType.ARRAY:
            return f"arr[{TYPE_SHORT_NAMES.get(self.item_type, '?')}]"
        return TYPE_SHORT_NAMES[self.type]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF ne order: ne0 (the contiguous row length) first
    type_id: int  # raw ggml type id; ``ggml_type`` is None when the gguf package does not know it
    offset: int  # relative to the start of the data section
    data_start: int  # absolute byte offset in the file (the piece holding it, in a split set)
    piece: int = 0  # index of that piece (split.no); 0 for a single file

    @property
    def ggml_type(self) -> GGMLQuantizationType | None:
        try:
            return GGMLQuantizationType(self.type_id)
        except ValueError:
            return None

    @property
    def type_name(self) -> str:
        t = self.ggml_type
        return t.name if t is not None else f"unknown({self.type_id})"

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)  # Python ints: a corrupt u64 dim must not overflow

    @property
    def n_bytes(self) -> int:
        """Bytes of data; -1 when the type is unknown or the row is not a whole number of blocks."""
        t = self.ggml_type
        if t is None or t not in GGML_QUANT_SIZES:
            return -1
        block_size, type_size = GGML_QUANT_SIZES[t]
        if not self.shape or self.shape[0] % block_size:
            return -1
        return self.n_elements // block_size * type_size

    @property
    def data_end(self) -> int:
        return self.data_start + max(self.n_bytes, 0)


@dataclass
class GGUFFile:
    """Header, metadata and tensor index of one GGUF file, read without touching tensor data."""

    path: Path
    version: int
    kv: dict[str, KeyValue]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int
    file_size: int  # of this file; of the first piece for a split set (``total_size``: all)
    buffer: Any = field(repr=False)
    duplicate_keys: list[str] = field(default_factory=list)
    duplicate_tensors: list[str] = field(default_factory=list)
    pieces: list["GGUFFile"] = field(default_factory=list, repr=False)  # split set; else empty

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFFile":
        """The model at ``path``: the file, or the whole split set ``path`` is a piece of."""
        first = cls.open_piece(path)
        count, number = split_fields(first)
        if count <= 1:
            return first
        paths = split_piece_paths(first.path, number, count)
        if number != 0:
            first.close()
            first = cls.open_piece(paths[0])
        pieces = [first]
        try:
            pieces += [_open_split_piece(p, i, count) for i, p in enumerate(paths) if i]
        except GGUFFormatError:
            for piece in pieces:  # the mappings opened so far
                piece.close()
            raise
        return cls.from_pieces(pieces)

    @classmethod
    def open_piece(cls, path: str | os.PathLike) -> "GGUFFile":
        """Exactly the one file at ``path``, even when it is a piece of a split set."""
        return _HeaderParser(Path(path)).parse()

    @classmethod
    def from_pieces(cls, pieces: list["GGUFFile"]) -> "GGUFFile":
        """One model over a split set's pieces (``pieces[i]`` holds split.no i)."""
        first, tensors, seen, duplicates = pieces[0], [], set(), []
        for number, piece in enumerate(pieces):
            for t in piece.tensors:
                if t.name in seen:  # within a piece or across pieces
                    duplicates.append(t.name)
                seen.add(t.name)
                tensors.append(replace(t, piece=number))
        return cls(first.path, first.version, first.kv, tensors, first.alignment,
                   first.data_offset, first.file_size, first.buffer, first.duplicate_keys,
                   duplicates, pieces)

    @property
    def piece_files(self) -> list["GGUFFile"]:
        """The files holding the data: the split set's pieces, or this file alone."""
        return self.pieces or [self]

    @property
    def piece_paths(self) -> list[Path]:
        return [piece.path for piece in self.piece_files]

    @property
    def total_size(self) -> int:
        """Bytes of every file of the model."""
        return sum(piece.file_size for piece in self.piece_files)

    def piece_of(self, info: TensorInfo) -> "GGUFFile":
        return self.piece_files[info.piece]

    def get(self, key: str, default: Any = None) -> Any:
        item = self.kv.get(key)
        return default if item is None else item.value

    @property
    def architecture(self) -> str | None:
        arch = self.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def tensor(self, name: str) -> TensorInfo | None:
        return self._by_name().get(name)

    def _by_name(self) -> dict[str, TensorInfo]:
        if not hasattr(self, "_tensor_index"):
            self._tensor_index = {t.name: t for t in self.tensors}
        return self._tensor_index

    def tensor_bytes(self, info: TensorInfo) -> memoryview:
        """The tensor's stored bytes, as a view of the mmap (nothing is copied)."""
        return memoryview(self.piece_of(info).buffer)[info.data_start: info.data_end]

    def close(self) -> None:
        for piece in self.piece_files:
            if isinstance(piece.buffer, mmap.mmap):
                piece.buffer.close()


SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)


def split_fields(gf: GGUFFile) -> tuple[int, int]:
    """(split.count, split.no) of a file; (0, 0) when it is not a piece of a split set."""
    count, number = gf.get(SPLIT_COUNT, 0), gf.get(SPLIT_NO, 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (count, number)):
        raise GGUFFormatError(gf.path, "split-piece-mismatch",
                              f"{SPLIT_COUNT} / {SPLIT_NO} are not integers")
    if count > 1 and not 0 <= number < count:
        raise GGUFFormatError(gf.path, "split-piece-mismatch",
                              f"{SPLIT_NO} = {number} is outside a {count}-piece split set")
    return count, number


def split_piece_name(prefix: str, number: int, count: int) -> str:
    """llama.cpp's ``llama_split_path``: piece ``number`` (0-based) is named
    ``PREFIX-{number + 1:05d}-of-{count:05d}.gguf``."""
    return f"{prefix}-{number + 1:05d}-of-{count:05d}.gguf"


def split_piece_paths(path: Path, number: int, count: int) -> list[Path]:
    """Every piece's path, from the path of piece ``number`` (llama.cpp's
    ``llama_split_prefix``)."""
    suffix = split_piece_name("", number, count)
    if not path.name.endswith(suffix):
        raise GGUFFormatError(path, "split-piece-mismatch",
                              f"piece {number + 1} of a {count}-piece split set, but its name does "
                              f"not end in '{suffix}'; rename it as gguf-split names pieces")
    prefix = path.name[:-len(suffix)]
    return [path.with_name(split_piece_name(prefix, i, count)) for i in range(count)]


def _open_split_piece(path: Path, number: int, count: int) -> GGUFFile:
    if not path.exists():
        raise GGUFFormatError(path, "split-piece-missing",
                              f"piece {number + 1} of {count} of the split set is missing; "
                              "download it into the folder of the other pieces")
    piece = GGUFFile.open_piece(path)
    if split_fields(piece) != (count, number):
        found_count, found_no = split_fields(piece)
        raise GGUFFormatError(path, "split-piece-mismatch",
                              f"expected piece {number + 1} of {count}, the file says piece "
                              f"{found_no + 1} of {found_count}; re-download the set")
    return piece


class _HeaderParser:
    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.context = "the header"

    def fail(self, rule: str, message: str) -> GGUFFormatError:
        return GGUFFormatError(self.path, rule, message)

    def parse(self) -> GGUFFile:
        buf = self._map()
        self.buf, self.size = buf, len(buf)
        magic = self._take(4)
        if magic != GGUF_MAGIC:
            raise self.fail("not-gguf", f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        version = self._scalar(GGUFValueType.UINT32)
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0:
                raise self.fail("unsupported-version", "big-endian GGUF files are not supported")
            raise self.fail("unsupported-version",
                            f"GGUF version {version} is not supported (supported: 2, 3)")
        n_tensors = self._scalar(GGUFValueType.UINT64)
        n_kv = self._scalar(GGUFValueType.UINT64)
        # Every tensor-info and key record takes well over 8 bytes: larger counts are corruption.
        if n_tensors > self.size // 8 or n_kv > self.size // 8:
            raise self.fail("header-corrupt",
                            f"header claims {n_tensors} tensors and {n_kv} keys, more than a "
                            f"{self.size}-byte file can hold")
        kv: dict[str, KeyValue] = {}
        duplicate_keys: list[str] = []
        for index in range(n_kv):
            self.context = f"metadata entry {index}"
            item = self._key_value()
            if item.key in kv:
                duplicate_keys.append(item.key)
            else:
                kv[item.key] = item
        tensors: list[TensorInfo] = []
        seen: set[str] = set()
        duplicate_tensors: list[str] = []
        infos = []
        for index in range(n_tensors):
            self.context = f"tensor info {index}"
            name = self._string()
            self.context = f"tensor info of '{name}'"
            n_dims = self._scalar(GGUFValueType.UINT32)
            if n_dims > MAX_DIMS:
                raise self.fail("header-corrupt", f"tensor '{name}' has {n_dims} dimensions "
                                                  f"(GGUF allows at most {MAX_DIMS})")
            shape = tuple(self._scalar(GGUFValueType.UINT64) for _ in range(n_dims))
            type_id = self._scalar(GGUFValueType.UINT32)
            offset = self._scalar(GGUFValueType.UINT64)
            if name in seen:
                duplicate_tensors.append(name)
            seen.add(name)
            infos.append((name, shape, type_id, offset))
        alignment = DEFAULT_ALIGNMENT
        align_kv = kv.get("general.alignment")
        if align_kv is not None:
            value = align_kv.value
            if align_kv.type != GGUFValueType.UINT32 or value == 0 or value & (value - 1):
                raise self.fail("header-corrupt",
                                f"general.alignment must be a power-of-two u32, got {value!r}")
            alignment = value
        data_offset = -(-self.offset // alignment) * alignment
        for name, shape, type_id, offset in infos:
            tensors.append(TensorInfo(name, shape, type_id, offset, data_offset + offset))
        return GGUFFile(self.path, version, kv, tensors, alignment, data_offset, self.size, buf,
                        duplicate_keys, duplicate_tensors)

    def _map(self):
        path = self.path
        if not path.exists():
            raise self.fail("unreadable", "no such file")
        if path.is_dir():
            raise self.fail("unreadable", "is a directory, expected a .gguf file")
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise self.fail("not-gguf", "empty file, not a GGUF")
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except PermissionError:
            raise self.fail("unreadable", "permission denied") from None
        except OSError as e:
            raise self.fail("unreadable", f"cannot read ({e.strerror or e})") from None

    def _take(self, n: int) -> bytes:
        end = self.offset + n
        if end > self.size:
            raise self.fail("header-truncated",
                            f"file ends at byte {self.size} inside {self.context} (needs {end}); "
                            "the download is probably incomplete")
        data = self.buf[self.offset:end]
        self.offset = end
        return data

    def _scalar(self, vtype: GGUFValueType):
        fmt = _SCALAR_FORMATS[vtype]
        (value,) = struct.unpack(fmt, self._take(struct.calcsize(fmt)))
        return value

    def _string(self) -> str:
        length = self._scalar(GGUFValueType.UINT64)
        if self.offset + length > self.size:
            raise self.fail("header-truncated" if length < self.size else "header-corrupt",
                            f"a string of {length} bytes in {self.context} runs past the end of "
                            f"the {self.size}-byte file")
        raw = self._take(length)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("header-corrupt", f"invalid UTF-8 string in {self.context}") from None

    def _value_type(self) -> GGUFValueType:
        raw = self._scalar(GGUFValueType.UINT32)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail("header-corrupt", f"unknown value type {raw} in {self.context}") from None

    def _key_value(self) -> KeyValue:
        start = self.offset
        key = self._string()
        self.context = f"metadata key '{key}'"
        vtype = self._value_type()
        item_type = None
        if vtype == GGUFValueType.ARRAY:
            item_type = self._value_type()
            count = self._scalar(GGUFValueType.UINT64)
            value = self._array(item_type, count)
        elif vtype == GGUFValueType.STRING:
            value = self._string()
        else:
            value = self._scalar(vtype)
        return KeyValue(key, vtype, value, item_type, start, self.offset)

    def _array(self, item_type: GGUFValueType, count: int):
        if item_type == GGUFValueType.ARRAY:
            raise self.fail("header-corrupt", f"nested arrays in {self.context} are not supported")
        if item_type == GGUFValueType.STRING:
            if count > (self.size - self.offset) // 8:
                raise self.fail("header-corrupt", f"{self.context} claims {count} strings, more "
                                                  "than the rest of the file can hold")
            start = self.offset
            for _ in range(count):
                self._take(self._scalar(GGUFValueType.UINT64))
            return StringArray(self.buf, start, count)
        dtype = np.dtype(_NUMPY_DTYPES[item_type])
        raw = self._take(count * dtype.itemsize) if count <= self.size else self._take(self.size)
        return np.frombuffer(raw, dtype=dtype)
