"""Repair what doctor finds repairable, writing a new GGUF file byte-exactly and atomically.

What fix does: retypes keys to the type llama.cpp demands, infers `expert_count` and
`expert_feed_forward_length` from tensor shapes, applies `--set KEY=VALUE`, renames tensors
to llama.cpp's names, stacks one-expert-per-tensor layouts into `_exps` tensors (bytes
concatenated in expert order, never re-encoded) and lays tensor data out aligned.

How it stays exact: unchanged metadata records are copied as raw bytes from the source;
tensor bytes are streamed from the source mmap in chunks. The new header is checked by
doctor before anything is written, the written file is checked again, and only then is the
temporary file renamed over the output. The input is never opened for writing.

A split set is repaired as one model and written as a set of the same layout (each tensor in
the piece that held it, later pieces keeping their own records), or with ``merge`` as one file
without the ``split.*`` keys. Every piece is written and the new set checked by doctor before
the first rename.
"""

from __future__ import annotations

import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gguf import GGUFValueType

from moeswap.errors import MoeswapError
from moeswap.formats.gguf_file import (
    _SCALAR_FORMATS, GGUF_MAGIC, SPLIT_KEYS, SPLIT_TENSORS, TYPE_SHORT_NAMES, GGUFFile,
    KeyValue, TensorInfo, split_piece_paths,
)
from moeswap.formats.gguf_moe import (
    ARCH_KEY_TYPES, MoEView, arch_key, canonical_alias,
)
from moeswap.formats.atomic_file import remove_stale_temps, temp_path, terminate_as_interrupt
from moeswap.formats.file_checks import same_record_value, split_expert_groups
from moeswap.formats.validation import ERROR, Finding, check
from moeswap.gguf_tools.doctor import Report, diagnose

CHUNK = 64 << 20  # bytes copied per write: memory stays small on any file size
# Problems no rewrite can solve: the source data itself is ambiguous or absent.
_SOURCE_BLOCKERS = ("duplicate-key", "duplicate-tensor", "tensor-data-past-eof",
                    "unknown-tensor-type", "invalid-tensor-shape", "mixed-expert-types",
                    "tensor-data-overlap", "tensor-size-mismatch")


@dataclass(frozen=True)
class OutputTensor:
    name: str
    shape: tuple[int, ...]  # ne order
    type_id: int
    sources: tuple[TensorInfo, ...]  # copied back to back: one, or one per expert when stacking

    @property
    def n_bytes(self) -> int:
        return sum(s.n_bytes for s in self.sources)


@dataclass(frozen=True)
class OutputFile:
    """One file fix writes: a single file, or one piece of a split set."""

    source: GGUFFile  # the file whose raw bytes the unchanged records are copied from
    kv: dict[str, KeyValue]  # records with end == 0 are new
    tensors: list[OutputTensor]


@dataclass
class FixPlan:
    source: GGUFFile
    kv: dict[str, KeyValue]  # output metadata in order; records with end == 0 are new
    tensors: list[OutputTensor]
    actions: list[str]
    remaining: list[Finding] = field(default_factory=list)  # doctor on the planned header
    files: list[OutputFile] = field(default_factory=list)  # what is written, in order

    @property
    def blockers(self) -> list[Finding]:
        return [f for f in self.remaining if f.severity == ERROR]


@dataclass(frozen=True)
class FixResult:
    plan: FixPlan
    output: Path | None  # None for a dry run or when nothing needed repair; a set's first piece
    report: Report | None  # doctor on the written file


# --- values ---------------------------------------------------------------------------------

def _convert(value: Any, target: GGUFValueType) -> Any | None:
    """`value` as `target` when that is exact (floats: nearest f32), else None."""
    if isinstance(value, bool):
        return value if target == GGUFValueType.BOOL else None
    if target == GGUFValueType.BOOL:
        return bool(value) if value in (0, 1) else None
    if target in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(value) if isinstance(value, (int, float)) else None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    if not isinstance(value, int) or target not in _SCALAR_FORMATS:
        return None
    try:
        struct.pack(_SCALAR_FORMATS[target], value)
    except struct.error:
        return None
    return value


def _parse_text(text: str, vtype: GGUFValueType, key: str) -> Any:
    def bad() -> MoeswapError:
        return MoeswapError(f"--set {key}={text}: not a valid {TYPE_SHORT_NAMES[vtype]} value")
    if vtype == GGUFValueType.STRING:
        return text
    if vtype == GGUFValueType.BOOL:
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
        raise bad()
    try:
        number = float(text) if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) \
            else int(text, 0)
    except ValueError:
        raise bad() from None
    value = _convert(number, vtype)
    if value is None:
        raise bad()
    return value


def _guess_type(text: str) -> GGUFValueType:
    if text.lower() in ("true", "false"):
        return GGUFValueType.BOOL
    try:
        number = int(text, 0)
        return GGUFValueType.UINT32 if 0 <= number < 1 << 32 else GGUFValueType.INT64
    except ValueError:
        pass
    try:
        float(text)
        return GGUFValueType.FLOAT32
    except ValueError:
        return GGUFValueType.STRING


def set_value_type(gf: GGUFFile, key: str, text: str) -> GGUFValueType:
    """The type a `--set` value gets: llama.cpp's type for its known keys, the existing type
    for other keys present, otherwise what the text looks like (integers as u32)."""
    arch = gf.architecture
    if arch and key.startswith(arch + ".") and key[len(arch) + 1:] in ARCH_KEY_TYPES:
        return ARCH_KEY_TYPES[key[len(arch) + 1:]]
    existing = gf.kv.get(key)
    if existing is not None:
        if existing.type == GGUFValueType.ARRAY:
            raise MoeswapError(f"--set {key}: arrays cannot be set from the command line")
        return existing.type
    return _guess_type(text)


def parse_sets(gf: GGUFFile, assignments: list[str]) -> dict[str, tuple[GGUFValueType, Any]]:
    parsed = {}
    for item in assignments:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise MoeswapError(f"--set {item}: expected KEY=VALUE")
        if key == "general.alignment":
            raise MoeswapError("--set general.alignment: changing the alignment is not supported")
        vtype = set_value_type(gf, key, text)
        parsed[key] = (vtype, _parse_text(text, vtype, key))
    return parsed


def _encode_record(key: str, vtype: GGUFValueType, value: Any) -> bytes:
    name = key.encode()
    out = struct.pack("<Q", len(name)) + name + struct.pack("<I", vtype)
    if vtype == GGUFValueType.STRING:
        raw = value.encode()
        return out + struct.pack("<Q", len(raw)) + raw
    return out + struct.pack(_SCALAR_FORMATS[vtype], value)


# --- planning -------------------------------------------------------------------------------

def _plan_keys(gf: GGUFFile, view: MoEView, sets: dict, source_rules: set[str],
               actions: list[str]) -> dict[str, KeyValue]:
    kv = dict(gf.kv)

    def put(key: str, vtype: GGUFValueType, value: Any, action: str) -> None:
        kv[key] = KeyValue(key, vtype, value, None, 0, 0)
        actions.append(action)

    for key, (vtype, value) in sets.items():
        put(key, vtype, value, f"set {key} = {value!r} ({TYPE_SHORT_NAMES[vtype]})")
    if gf.architecture is None:
        return kv
    for suffix, expected in ARCH_KEY_TYPES.items():
        key = arch_key(gf, suffix)
        item = kv.get(key)
        if item is None or item.type == expected or key in sets or item.type == GGUFValueType.ARRAY:
            continue  # per-layer arrays and arrays in general are left alone
        value = _convert(item.value, expected)
        if value is not None:
            put(key, expected, value, f"retype {key} from {item.type_name} to "
                                      f"{TYPE_SHORT_NAMES[expected]} (value {value!r})")
    # Only what doctor asked for, and only what the tensor shapes determine.
    inferred = {"missing-expert-count": ("expert_count", view.expert_count_from_shapes()),
                "missing-expert-feed-forward-length":
                    ("expert_feed_forward_length", view.expert_width_from_shapes())}
    for rule, (suffix, value) in inferred.items():
        key = arch_key(gf, suffix)
        if rule in source_rules and key not in kv and value is not None:
            put(key, GGUFValueType.UINT32, value, f"add {key} = {value} (from tensor shapes)")
    return kv


def _plan_tensors(gf: GGUFFile, n_expert: int | None, actions: list[str]) -> list[OutputTensor]:
    groups = split_expert_groups(gf)
    first_of_group = {members[0][1].name: key for key, members in groups.items()}
    in_group = {t.name for members in groups.values() for _, t in members}
    tensors = []
    for t in gf.tensors:
        if t.name in first_of_group:
            tensors.append(_stack(first_of_group[t.name], groups[first_of_group[t.name]],
                                  n_expert, actions))
        elif t.name not in in_group:
            name = canonical_alias(t.name) or t.name
            if name != t.name:
                actions.append(f"rename tensor '{t.name}' to '{name}'")
            tensors.append(OutputTensor(name, t.shape, t.type_id, (t,)))
    return tensors


def _stack(group: tuple[int, str], members: list, n_expert: int | None,
           actions: list[str]) -> OutputTensor:
    layer, part = group
    members = sorted(members, key=lambda m: m[0])
    experts = [e for e, _ in members]
    first = members[0][1]
    name = f"blk.{layer}.ffn_{part}_exps.weight"
    if experts != list(range(len(members))) or (n_expert and len(members) != n_expert):
        raise MoeswapError(f"{first.name}: layer {layer} has '{part}' experts {experts}, not "
                           f"0..{(n_expert or len(members)) - 1}; cannot stack them into '{name}'")
    actions.append(f"stack {len(members)} tensors '{first.name}'... into '{name}' "
                   f"({first.type_name}, bytes copied)")
    # {D, F} per expert -> {D, F, E}: the expert becomes the outermost dimension.
    return OutputTensor(name, (*first.shape, len(members)), first.type_id,
                        tuple(t for _, t in members))


def _output_files(p: FixPlan, merge: bool, source_rules: set[str]) -> list[OutputFile]:
    """A single file, the merged set, or the set's pieces with each tensor where it was."""
    gf = p.source
    if not gf.pieces:
        return [OutputFile(gf, p.kv, p.tensors)]
    if merge:
        p.actions.append(f"merge the {len(gf.pieces)} pieces into one file (split.* keys dropped)")
        return [OutputFile(gf, {k: v for k, v in p.kv.items() if k not in SPLIT_KEYS},
                           p.tensors)]
    by_piece: list[list[OutputTensor]] = [[] for _ in gf.pieces]
    for t in p.tensors:
        by_piece[t.sources[0].piece].append(t)
    recount = "split-tensor-count" in source_rules or len(p.tensors) != len(gf.tensors)
    files = []
    for number, (piece, tensors) in enumerate(zip(gf.pieces, by_piece)):
        kv = dict(p.kv) if number == 0 else _later_piece_keys(p, piece)
        if recount:
            kv[SPLIT_TENSORS] = KeyValue(SPLIT_TENSORS, GGUFValueType.INT32, len(p.tensors),
                                         None, 0, 0)
        files.append(OutputFile(piece, kv, tensors))
    if recount:
        p.actions.append(f"set {SPLIT_TENSORS} = {len(p.tensors)} in every piece")
    return files


def _later_piece_keys(p: FixPlan, piece: GGUFFile) -> dict[str, KeyValue]:
    """A later piece's own records, less those disagreeing with the first piece's (llama.cpp
    reads only the first piece's metadata)."""
    kv = {}
    for key, item in piece.kv.items():
        ours = p.kv.get(key)
        if key in SPLIT_KEYS or ours is None or same_record_value(ours, item):
            kv[key] = item
        else:
            p.actions.append(f"drop key {key} from {piece.path.name} (the first piece's value "
                             "stands)")
    return kv


def _header_bytes(gf: GGUFFile, kv: dict[str, KeyValue], tensors: list[OutputTensor],
                  offsets: list[int]) -> bytes:
    parts = [GGUF_MAGIC, struct.pack("<IQQ", gf.version, len(tensors), len(kv))]
    for item in kv.values():
        if item.end:  # unchanged record: the source's exact bytes
            parts.append(bytes(gf.buffer[item.start:item.end]))
        else:
            parts.append(_encode_record(item.key, item.type, item.value))
    for t, offset in zip(tensors, offsets):
        name = t.name.encode()
        parts.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape)))
        parts.append(struct.pack(f"<{len(t.shape)}Q", *t.shape))
        parts.append(struct.pack("<IQ", t.type_id, offset))
    return b"".join(parts)


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan(gf: GGUFFile, assignments: list[str] = (), merge: bool = False) -> FixPlan:
    """What fix would write, checked by doctor before any byte is written. ``merge``: write a
    split set as one file."""
    source_findings = check(gf)
    if any(f.rule in _SOURCE_BLOCKERS for f in source_findings):
        return FixPlan(gf, dict(gf.kv), [], [], source_findings)
    view = MoEView(gf)
    actions: list[str] = []
    source_rules = {f.rule for f in source_findings}
    kv = _plan_keys(gf, view, parse_sets(gf, list(assignments)), source_rules, actions)
    n_expert = kv.get(arch_key(gf, "expert_count"))
    n_expert = n_expert.value if n_expert is not None and isinstance(n_expert.value, int) else None
    tensors = _plan_tensors(gf, n_expert, actions)
    if "misaligned-tensor-offset" in source_rules:
        actions.append(f"realign tensor data to {gf.alignment} bytes")
    result = FixPlan(gf, kv, tensors, actions)
    result.files = _output_files(result, merge, source_rules)
    planned = [_planned_file(f, f.source.path) for f in result.files]
    result.remaining = check(planned[0] if len(planned) == 1 else GGUFFile.from_pieces(planned))
    return result


def _layout(file: OutputFile) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for t in file.tensors:
        offsets.append(cursor)
        cursor += _pad(t.n_bytes, file.source.alignment)
    return offsets, cursor


def _planned_file(file: OutputFile, path: Path) -> GGUFFile:
    """The output's header as a GGUFFile (no data), for doctor to check before writing."""
    offsets, data_size = _layout(file)
    header = _header_bytes(file.source, file.kv, file.tensors, offsets)
    alignment = file.source.alignment
    data_offset = _pad(len(header), alignment)
    infos = [TensorInfo(t.name, t.shape, t.type_id, off, data_offset + off)
             for t, off in zip(file.tensors, offsets)]
    return GGUFFile(path, file.source.version, file.kv, infos, alignment, data_offset,
                    data_offset + data_size, None)


# --- writing --------------------------------------------------------------------------------

def _write(gf: GGUFFile, file: OutputFile, out, on_progress: Callable[[int], None] | None):
    offsets, _ = _layout(file)
    header = _header_bytes(file.source, file.kv, file.tensors, offsets)
    alignment = file.source.alignment
    out.write(header)
    out.write(bytes(_pad(len(header), alignment) - len(header)))
    for t in file.tensors:
        for src in t.sources:
            # Views are released even on error, so the source mmap can close.
            with memoryview(gf.piece_of(src).buffer) as view:
                for start in range(src.data_start, src.data_end, CHUNK):
                    with view[start:min(start + CHUNK, src.data_end)] as chunk:
                        out.write(chunk)
                        if on_progress:
                            on_progress(len(chunk))
        out.write(bytes(_pad(t.n_bytes, alignment) - t.n_bytes))


def output_paths(out: Path, n_files: int) -> list[Path]:
    """``out`` for one file; for a set, gguf-split's names from ``out`` (``fixed.gguf`` or
    ``fixed-00001-of-00003.gguf`` -> ``fixed-0000i-of-00003.gguf``)."""
    if n_files == 1:
        return [out]
    first_suffix = f"-00001-of-{n_files:05d}.gguf"
    first = out if out.name.endswith(first_suffix) else \
        out.with_name(out.name.removesuffix(".gguf") + first_suffix)
    return split_piece_paths(first, 0, n_files)


def _check_paths(sources: list[Path], out: Path) -> None:
    if out.is_dir():
        raise MoeswapError(f"{out}: is a directory; -o needs a file path")
    if out.exists() and any(os.path.samefile(src, out) for src in sources):
        raise MoeswapError(f"{out}: is an input file; fix never overwrites its input, "
                           "choose another -o path")
    if not out.parent.is_dir():
        raise MoeswapError(f"{out}: directory {out.parent} does not exist")


def _refusal(path: str, blockers: list[Finding]) -> MoeswapError:
    listed = "; ".join(f"[{f.rule}] {f.message} (fix: {f.fix})" for f in blockers)
    return MoeswapError(f"{path}: fix cannot repair {len(blockers)} problem(s), nothing "
                        f"written: {listed}")


def fix_file(src: str | os.PathLike, out: str | os.PathLike, assignments: list[str] = (),
             dry_run: bool = False, on_progress: Callable[[int], None] | None = None,
             on_start: Callable[[int], None] | None = None, merge: bool = False) -> FixResult:
    """Plan, refuse or write: the output appears only complete and doctor-clean of errors.
    ``merge``: a split set becomes one file ``out``."""
    src, out = Path(src), Path(out)
    gf = GGUFFile.open(src)
    try:
        if not dry_run:
            _check_paths(gf.piece_paths, out)
        p = plan(gf, assignments, merge)
        outs = output_paths(out, max(len(p.files), 1))  # no files: a refused plan
        if not dry_run:
            for path in outs[1:]:
                _check_paths(gf.piece_paths, path)
        if dry_run:
            return FixResult(p, None, None)
        if p.blockers:
            raise _refusal(str(src), p.blockers)
        if not p.actions:
            return FixResult(p, None, None)
        if on_start:
            on_start(sum(t.n_bytes for t in p.tensors))
        return FixResult(p, outs[0], _write_atomically(p, outs, on_progress))
    finally:
        gf.close()


def _write_atomically(p: FixPlan, outs: list[Path], on_progress) -> Report:
    """Every file to a temporary name (formats.atomic_file's: removed on failure and SIGTERM,
    and by the next fix when a kill left it), fsynced; the whole output checked; then renamed."""
    tmps: list[Path] = []
    with terminate_as_interrupt():
        try:
            return _write_checked(p, outs, tmps, on_progress)
        finally:
            for tmp in tmps:
                tmp.unlink(missing_ok=True)


def _write_checked(p: FixPlan, outs: list[Path], tmps: list[Path], on_progress) -> Report:
    for file, out in zip(p.files, outs):
        remove_stale_temps(out)
        tmps.append(temp_path(out))
        try:
            with open(tmps[-1], "wb") as f:
                _write(p.source, file, f, on_progress)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise MoeswapError(f"{out}: cannot write ({e.strerror or e}); "
                               "nothing written") from None
        shutil.copymode(file.source.path, tmps[-1])
    report = _diagnose_written(tmps, outs[0])
    errors = [f for f in report.findings if f.severity == ERROR]
    if errors:
        raise _refusal(str(outs[0]), errors)
    for tmp, out in zip(tmps, outs):
        os.replace(tmp, out)
    return report


def _diagnose_written(tmps: list[Path], first: Path) -> Report:
    """doctor on the written files, before they get their names."""
    if len(tmps) == 1:
        return Report(str(first), diagnose(tmps[0]).findings)
    written = GGUFFile.from_pieces([GGUFFile.open_piece(tmp) for tmp in tmps])
    try:
        return Report(str(first), check(written))
    finally:
        written.close()
