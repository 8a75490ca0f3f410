"""Validation of MoE GGUF files: a table of rules, each one small function.

Every finding carries a stable rule id, a severity, a message naming the key or tensor, and
the fix. Files that cannot be parsed at all become one finding with the rule of their
``GGUFFormatError``. Exit codes: 0 clean, 1 warnings only, 2 errors.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Callable, Iterator

import numpy as np
from gguf import GGUFValueType
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moeswap.errors import GGUFFormatError
from moeswap.formats.gguf_file import (
    SPLIT_KEYS, SPLIT_TENSORS, TYPE_SHORT_NAMES, GGUFFile, KeyValue, StringArray)
from moeswap.formats.gguf_moe import (
    ARCH_KEY_TYPES, MAX_EXPERTS, PER_LAYER_ARRAY_KEYS, ROUTED, ROUTER, MoEView, arch_key,
    canonical_alias, split_expert,
)

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    message: str
    fix: str


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    check: Callable[[GGUFFile, MoEView], Iterator[Finding]] | None  # None: raised by the reader
    summary: str
    fix: str


@dataclass
class Report:
    path: str
    findings: list[Finding]

    @property
    def readable(self) -> bool:
        """False when the header could not be parsed (the one finding says why)."""
        return not any(RULES_BY_ID[f.rule].check is None for f in self.findings)

    @property
    def exit_code(self) -> int:
        if any(f.severity == ERROR for f in self.findings):
            return 2
        return 1 if self.findings else 0

    def rule_ids(self) -> list[str]:
        return sorted({f.rule for f in self.findings})

    def to_json(self) -> dict:
        return {"file": self.path, "exit_code": self.exit_code,
                "findings": [asdict(f) for f in self.findings]}


def _finding(rule_id: str, message: str) -> Finding:
    rule = RULES_BY_ID[rule_id]
    return Finding(rule.id, rule.severity, message, rule.fix)


# --- rules over the parsed file -------------------------------------------------------------

def check_duplicate_keys(gf, view):
    for key in dict.fromkeys(gf.duplicate_keys):
        yield _finding("duplicate-key", f"key {key} appears more than once")


def check_duplicate_tensors(gf, view):
    for name in dict.fromkeys(gf.duplicate_tensors):
        yield _finding("duplicate-tensor", f"tensor '{name}' appears more than once")


def check_architecture(gf, view):
    if gf.architecture is None:
        yield _finding("missing-architecture",
                       "key general.architecture is missing or not a string")


def check_known_architecture(gf, view):
    arch = gf.architecture
    if arch is not None and not view.metadata.known_to_llama_cpp:
        yield _finding("unknown-architecture",
                       f"architecture '{arch}' (general.architecture) is unknown to llama.cpp "
                       f"as of the installed gguf package {_gguf_version()}")


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(version unknown)"


def check_required_keys(gf, view):
    if gf.architecture is None:
        return
    for suffix in ("block_count", "embedding_length"):
        if arch_key(gf, suffix) not in gf.kv:
            yield _finding("missing-required-key", f"key {arch_key(gf, suffix)} is missing")


def check_key_types(gf, view):
    if gf.architecture is None:
        return
    for suffix, expected in ARCH_KEY_TYPES.items():
        item = gf.kv.get(arch_key(gf, suffix))
        if item is None or item.type == expected:
            continue
        if (suffix in PER_LAYER_ARRAY_KEYS and item.type == GGUFValueType.ARRAY
                and item.item_type in (GGUFValueType.INT32, GGUFValueType.UINT32)):
            continue
        # Worded as llama.cpp's loader words it.
        yield _finding("wrong-key-type", f"key {item.key} has wrong type {item.type_name} but "
                                         f"expected type {TYPE_SHORT_NAMES[expected]}")


def _has_experts(view: MoEView) -> bool:
    return any(layer.is_moe for layer in view.layers)


def check_expert_count_present(gf, view):
    if gf.architecture and _has_experts(view) and arch_key(gf, "expert_count") not in gf.kv:
        yield _finding("missing-expert-count",
                       f"key {arch_key(gf, 'expert_count')} is missing but the file has expert "
                       "tensors: llama.cpp would run the model dense or fail")


def check_expert_used_count_present(gf, view):
    n_expert = view.metadata.expert_count
    if gf.architecture and (n_expert or _has_experts(view)) \
            and arch_key(gf, "expert_used_count") not in gf.kv:
        yield _finding("missing-expert-used-count",
                       f"key {arch_key(gf, 'expert_used_count')} is missing")


def check_expert_feed_forward_length_present(gf, view):
    # Mixtral-style `llama` files use feed_forward_length for the experts; for an unknown
    # architecture no one can say which key it needs.
    if view.metadata.known_to_llama_cpp and gf.architecture != "llama" and _has_experts(view) \
            and arch_key(gf, "expert_feed_forward_length") not in gf.kv:
        yield _finding("missing-expert-feed-forward-length",
                       f"key {arch_key(gf, 'expert_feed_forward_length')} is missing")


def check_expert_count_limit(gf, view):
    n_expert = view.metadata.expert_count
    if n_expert is not None and n_expert > MAX_EXPERTS:
        yield _finding("expert-count-over-limit",
                       f"key {arch_key(gf, 'expert_count')} = {n_expert} exceeds llama.cpp's "
                       f"limit of {MAX_EXPERTS}")


def check_expert_used_zero(gf, view):
    n_expert, n_used = view.metadata.expert_count, view.metadata.expert_used_count
    if n_expert and n_used == 0:
        yield _finding("expert-used-zero", f"key {arch_key(gf, 'expert_used_count')} = 0 "
                                           f"with {n_expert} experts")


def check_expert_used_not_above_count(gf, view):
    n_expert, n_used = view.metadata.expert_count, view.metadata.expert_used_count
    if n_expert is not None and n_used is not None and n_used > n_expert:
        yield _finding("expert-used-gt-count",
                       f"key {arch_key(gf, 'expert_used_count')} = {n_used} exceeds "
                       f"{arch_key(gf, 'expert_count')} = {n_expert}")


def check_nonstandard_names(gf, view):
    for t in gf.tensors:
        canonical = canonical_alias(t.name)
        if canonical:
            yield _finding("nonstandard-expert-name",
                           f"tensor '{t.name}' should be named '{canonical}' for llama.cpp")


def split_expert_groups(gf: GGUFFile) -> dict[tuple[int, str], list]:
    """(layer, part) -> [(expert, TensorInfo)] of one-expert-per-tensor layouts."""
    groups: dict[tuple[int, str], list] = defaultdict(list)
    for t in gf.tensors:
        split = split_expert(t.name)
        if split:
            groups[(split.layer, split.part)].append((split.expert, t))
    return groups


def check_split_experts(gf, view):
    for (layer, part), members in sorted(split_expert_groups(gf).items()):
        yield _finding("legacy-split-experts",
                       f"layer {layer} stores {len(members)} '{part}' experts as separate tensors "
                       f"(e.g. '{members[0][1].name}'); llama.cpp expects "
                       f"'blk.{layer}.ffn_{part}_exps.weight'")


def check_split_expert_types(gf, view):
    for (layer, part), members in sorted(split_expert_groups(gf).items()):
        types = {t.type_name for _, t in members}
        shapes = {t.shape for _, t in members}
        if len(types) > 1 or len(shapes) > 1:
            yield _finding("mixed-expert-types",
                           f"the '{part}' experts of layer {layer} differ in type or shape "
                           f"({', '.join(sorted(types))}; {len(shapes)} shape(s)): they cannot be "
                           "stacked without re-encoding")


def check_layer_sequence(gf, view):
    present = {layer.index for layer in view.layers}
    n_blocks = view.metadata.block_count
    expected = n_blocks if n_blocks is not None else max(present, default=-1) + 1
    # A "trunk-only" GLM-4.5 file counts its MTP layers in block_count without their tensors;
    # llama.cpp loads it (they are optional when the probe tensor is absent).
    nextn = view.metadata.nextn_predict_layers or 0
    if nextn and not any(i >= expected - nextn for i in present):
        expected -= nextn
    n_missing = expected - sum(1 for i in present if i < expected)
    if n_missing:
        # Lazily: a corrupt block_count can be 2**32 - 1.
        first = list(islice((i for i in range(expected) if i not in present), 8))
        shown = ", ".join(map(str, first)) + (", ..." if n_missing > len(first) else "")
        yield _finding("missing-layer", f"no tensors for {n_missing} layer(s): {shown} "
                                        f"(block_count = {expected})")
    extra = sorted(i for i in present if i >= expected)
    if extra:
        yield _finding("missing-layer", f"tensors for layer {extra[0]} beyond "
                                        f"{arch_key(gf, 'block_count')} = {n_blocks}")


def check_router_present(gf, view):
    for layer in view.layers:
        if layer.is_moe and not any(t.name.endswith(".weight") for t in layer.of(ROUTER)):
            yield _finding("missing-router", f"layer {layer.index} has expert tensors but no "
                                             f"router 'blk.{layer.index}.ffn_gate_inp.weight'")


def _expected_expert_shape(part: str, n_embd, n_ff, n_expert):
    # {D, F, E} for gate/up, {F, D, E} for down, {D, 2F, E} for fused gate_up.
    if part == "down":
        return (n_ff, n_embd, n_expert)
    return (n_embd, 2 * n_ff if n_ff is not None and part == "gate_up" else n_ff, n_expert)


def check_expert_shapes(gf, view):
    meta = view.metadata
    n_ff = meta.expert_feed_forward_length
    if n_ff is None and gf.architecture == "llama":
        n_ff = gf.get(arch_key(gf, "feed_forward_length"))
        n_ff = n_ff if isinstance(n_ff, int) and not isinstance(n_ff, bool) else None
    for t in gf.tensors:
        role = view.roles[t.name]
        if role.role != ROUTED or role.kind != "weight" or split_expert(t.name):
            continue
        expected = _expected_expert_shape(role.part, meta.n_embd, n_ff, meta.expert_count)
        if len(t.shape) != 3 or any(e is not None and e != s for e, s in zip(expected, t.shape)):
            shown = tuple("?" if e is None else e for e in expected)
            yield _finding("expert-shape-mismatch",
                           f"tensor '{t.name}' has shape {list(t.shape)} but the metadata "
                           f"(n_embd, expert width, expert_count) says {list(shown)}")


def check_tensor_types(gf, view):
    for t in gf.tensors:
        if t.ggml_type is None:
            yield _finding("unknown-tensor-type", f"tensor '{t.name}' has unknown ggml type id "
                                                  f"{t.type_id}")


def check_tensor_shapes(gf, view):
    for t in gf.tensors:
        if t.ggml_type is not None and t.n_bytes < 0:
            yield _finding("invalid-tensor-shape",
                           f"tensor '{t.name}' of type {t.type_name} has shape {list(t.shape)}: "
                           "its rows are not a whole number of quant blocks")


def _where(gf: GGUFFile, t) -> str:
    """Names the piece holding a tensor, in a split set."""
    return f" (in {gf.piece_of(t).path.name})" if gf.pieces else ""


def check_alignment(gf, view):
    for t in gf.tensors:
        alignment = gf.piece_of(t).alignment
        if t.offset % alignment:
            yield _finding("misaligned-tensor-offset",
                           f"tensor '{t.name}'{_where(gf, t)} starts at data offset {t.offset}, "
                           f"not a multiple of the alignment {alignment}")


def check_data_in_file(gf, view):
    for t in gf.tensors:
        size = gf.piece_of(t).file_size
        if t.n_bytes >= 0 and t.data_end > size:
            yield _finding("tensor-data-past-eof",
                           f"tensor '{t.name}'{_where(gf, t)} needs bytes up to {t.data_end} but "
                           f"the file ends at {size}: the file is truncated")


def check_split_tensor_count(gf, view):
    expected = gf.get(SPLIT_TENSORS)
    if gf.pieces and expected != len(gf.tensors):
        # Worded as llama.cpp's loader words it.
        yield _finding("split-tensor-count",
                       f"corrupted model: {expected} tensors expected ({SPLIT_TENSORS} of "
                       f"{gf.path.name}) but {len(gf.tensors)} found in the "
                       f"{len(gf.pieces)} pieces")


def check_split_keys_agree(gf, view):
    first = gf.piece_files[0]
    for piece in gf.pieces[1:]:
        for key, item in piece.kv.items():
            ours = first.kv.get(key)
            if key in SPLIT_KEYS or ours is None or same_record_value(ours, item):
                continue
            yield _finding("split-key-differs",
                           f"key {key} is {_short(item.value)} in {piece.path.name} but "
                           f"{_short(ours.value)} in {first.path.name}, whose value llama.cpp "
                           "and moeswap use")


def same_record_value(x: KeyValue, y: KeyValue) -> bool:
    """Whether two metadata records hold the same type and value."""
    if x.type != y.type or x.item_type != y.item_type:
        return False
    if isinstance(x.value, np.ndarray):  # same types: y's value is of the same kind
        return np.array_equal(x.value, y.value)
    if isinstance(x.value, StringArray):
        return x.value.to_list() == y.value.to_list()
    return x.value == y.value


def _short(value) -> str:
    text = repr(value) if not isinstance(value, (np.ndarray, StringArray)) else \
        f"an array of {len(value)}"
    return text if len(text) <= 40 else text[:37] + "..."


_REREAD = "re-download or re-convert the file"
RULES: tuple[Rule, ...] = (
    # Raised by the reader while parsing the header.
    Rule("unreadable", ERROR, None, "the path is missing, a directory, or not readable",
         "check the path and its permissions"),
    Rule("not-gguf", ERROR, None, "the file does not start with the GGUF magic",
         "pass a .gguf file"),
    Rule("unsupported-version", ERROR, None, "GGUF version other than 2 or 3, or big-endian",
         "re-convert with a current llama.cpp"),
    Rule("header-truncated", ERROR, None, "the file ends inside the header", _REREAD),
    Rule("header-corrupt", ERROR, None, "impossible counts, types or strings in the header",
         _REREAD),
    Rule("split-piece-missing", ERROR, None, "a piece of a split set is not beside the others",
         "download the missing piece into the folder of the other pieces"),
    Rule("split-piece-mismatch", ERROR, None,
         "a piece's split.no / split.count or file name disagree with the set",
         "re-download the set, keeping gguf-split's names (NAME-00001-of-0000N.gguf)"),
    # Checks over the parsed header and tensor index.
    Rule("duplicate-key", ERROR, check_duplicate_keys, "a metadata key appears twice", _REREAD),
    Rule("duplicate-tensor", ERROR, check_duplicate_tensors, "a tensor name appears twice",
         _REREAD),
    Rule("missing-architecture", ERROR, check_architecture, "general.architecture missing",
         "moeswap fix --set general.architecture=NAME"),
    Rule("unknown-architecture", WARNING, check_known_architecture,
         "the architecture is not one llama.cpp knows",
         "check the name (e.g. Mixtral files use 'llama'); fix --set general.architecture=NAME "
         "only renames the key, not the other {arch}.* keys"),
    Rule("missing-required-key", ERROR, check_required_keys,
         "{arch}.block_count or {arch}.embedding_length missing", "moeswap fix --set KEY=VALUE"),
    Rule("wrong-key-type", ERROR, check_key_types,
         "a key stored with a type llama.cpp's loader rejects", "moeswap fix (retypes the key)"),
    Rule("missing-expert-count", ERROR, check_expert_count_present,
         "expert tensors but no {arch}.expert_count",
         "moeswap fix (infers it from the expert tensor shapes)"),
    Rule("missing-expert-used-count", ERROR, check_expert_used_count_present,
         "no {arch}.expert_used_count",
         "moeswap fix --set {arch}.expert_used_count=K (the model card's top-k; "
         "no shape holds it)"),
    Rule("missing-expert-feed-forward-length", WARNING, check_expert_feed_forward_length_present,
         "no {arch}.expert_feed_forward_length",
         "moeswap fix (infers it from the expert tensor shapes)"),
    Rule("expert-count-over-limit", ERROR, check_expert_count_limit,
         "expert_count above llama.cpp's limit of 512", "moeswap fix --set {arch}.expert_count=N"),
    Rule("expert-used-zero", ERROR, check_expert_used_zero,
         "expert_used_count = 0 with experts present",
         "moeswap fix --set {arch}.expert_used_count=K"),
    Rule("expert-used-gt-count", ERROR, check_expert_used_not_above_count,
         "expert_used_count > expert_count",
         "moeswap fix --set {arch}.expert_used_count=K"),
    Rule("nonstandard-expert-name", ERROR, check_nonstandard_names,
         "expert or router tensors under names llama.cpp does not look up",
         "moeswap fix (renames them)"),
    Rule("legacy-split-experts", ERROR, check_split_experts,
         "one tensor per expert (blk.N.ffn_gate.E.weight); current llama.cpp does not load them",
         "moeswap fix (stacks them into _exps tensors, bytes copied unchanged)"),
    Rule("mixed-expert-types", ERROR, check_split_expert_types,
         "per-expert tensors of one group differ in type or shape", "re-convert the model"),
    Rule("missing-layer", ERROR, check_layer_sequence,
         "a layer's tensors are absent or beyond block_count", _REREAD),
    Rule("missing-router", ERROR, check_router_present,
         "a layer has experts but no ffn_gate_inp router", _REREAD),
    Rule("expert-shape-mismatch", ERROR, check_expert_shapes,
         "expert tensor shapes disagree with n_embd / expert width / expert_count",
         "correct the metadata with moeswap fix --set, or re-convert"),
    Rule("unknown-tensor-type", ERROR, check_tensor_types, "a tensor type id ggml does not know",
         "use a newer moeswap/gguf, or re-convert"),
    Rule("invalid-tensor-shape", ERROR, check_tensor_shapes,
         "rows not a whole number of quant blocks",
         _REREAD),
    Rule("misaligned-tensor-offset", ERROR, check_alignment,
         "tensor data not aligned to general.alignment", "moeswap fix (rewrites the data section)"),
    Rule("tensor-data-past-eof", ERROR, check_data_in_file,
         "a tensor's data runs past the end of the file", _REREAD),
    Rule("split-tensor-count", ERROR, check_split_tensor_count,
         "split.tensors.count differs from the tensors the pieces hold",
         "re-download the set; if no tensor is missing, moeswap fix rewrites the count"),
    Rule("split-key-differs", WARNING, check_split_keys_agree,
         "a later piece of a split set gives a key another value than the first piece",
         "moeswap fix (drops the differing key from the later pieces)"),
)
RULES_BY_ID = {rule.id: rule for rule in RULES}


def check(gf: GGUFFile) -> list[Finding]:
    view = MoEView(gf)
    findings = [finding for rule in RULES if rule.check for finding in rule.check(gf, view)]
    if gf.architecture is None:
        return findings
    # Fix hints name the file's own keys.
    return [Finding(f.rule, f.severity, f.message, f.fix.replace("{arch}", gf.architecture))
            for f in findings]


def diagnose(path: str | os.PathLike) -> Report:
    """Doctor one file: never raises for a bad file; parse failures become findings."""
    try:
        gf = GGUFFile.open(path)
    except GGUFFormatError as e:
        rule = RULES_BY_ID[e.rule]
        return Report(str(path), [Finding(rule.id, rule.severity, str(e), rule.fix)])
    try:
        return Report(str(path), check(gf))
    finally:
        gf.close()


def render(report: Report, console: Console) -> None:
    if not report.findings:
        console.print(f"{report.path}: no problems found")
        return
    table = Table(title=f"{report.path}: {len(report.findings)} finding(s)")
    table.add_column("severity")
    table.add_column("rule", no_wrap=True)
    table.add_column("problem", overflow="fold", ratio=3)
    table.add_column("fix", overflow="fold", ratio=2)
    for f in report.findings:
        style = "red" if f.severity == ERROR else "yellow"
        table.add_row(f"[{style}]{f.severity}[/]", f.rule, escape(f.message), escape(f.fix))
    console.print(table)
