"""Checks of a GGUF file's structure and MoE metadata, each a small generator of problems
(rule id, message) over the header and tensor index: no tensor data is read, so they also run
on a header ``fix`` plans before writing. ``formats.validation`` puts them in its table."""

from __future__ import annotations

from collections import defaultdict
from itertools import islice

import numpy as np
from gguf import GGUFValueType

from moeswap.formats.findings import Problem
from moeswap.formats.gguf_file import (
    SPLIT_KEYS, SPLIT_TENSORS, TYPE_SHORT_NAMES, GGUFFile, KeyValue, StringArray)
from moeswap.formats.gguf_moe import (
    ARCH_KEY_TYPES, MAX_EXPERTS, PER_LAYER_ARRAY_KEYS, ROUTED, ROUTER, MoEView, arch_key,
    canonical_alias, split_expert,
)


def problem(rule_id: str, message: str) -> Problem:
    return rule_id, message


def check_duplicate_keys(gf, view):
    for key in dict.fromkeys(gf.duplicate_keys):
        yield problem("duplicate-key", f"key {key} appears more than once")


def check_duplicate_tensors(gf, view):
    for name in dict.fromkeys(gf.duplicate_tensors):
        yield problem("duplicate-tensor", f"tensor '{name}' appears more than once")


def check_architecture(gf, view):
    if gf.architecture is None:
        yield problem("missing-architecture",
                       "key general.architecture is missing or not a string")


def check_known_architecture(gf, view):
    arch = gf.architecture
    if arch is not None and not view.metadata.known_to_llama_cpp:
        yield problem("unknown-architecture",
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
            yield problem("missing-required-key", f"key {arch_key(gf, suffix)} is missing")


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
        yield problem("wrong-key-type", f"key {item.key} has wrong type {item.type_name} but "
                                         f"expected type {TYPE_SHORT_NAMES[expected]}")


def check_per_layer_arrays(gf, view):
    """llama.cpp's get_key_or_arr takes a per-layer array only with one entry per block."""
    n_blocks = view.metadata.block_count
    if gf.architecture is None or n_blocks is None:
        return
    for suffix in sorted(PER_LAYER_ARRAY_KEYS):
        item = gf.kv.get(arch_key(gf, suffix))
        if item is not None and item.type == GGUFValueType.ARRAY and len(item.value) != n_blocks:
            # Worded as llama.cpp's loader words it.
            yield problem("per-layer-array-length",
                          f"key {item.key} has wrong array length; expected {n_blocks} "
                          f"({arch_key(gf, 'block_count')}), got {len(item.value)}")


def _has_experts(view: MoEView) -> bool:
    return any(layer.is_moe for layer in view.layers)


def check_expert_count_present(gf, view):
    if gf.architecture and _has_experts(view) and arch_key(gf, "expert_count") not in gf.kv:
        yield problem("missing-expert-count",
                       f"key {arch_key(gf, 'expert_count')} is missing but the file has expert "
                       "tensors: llama.cpp would run the model dense or fail")


def check_expert_used_count_present(gf, view):
    n_expert = view.metadata.expert_count
    if gf.architecture and (n_expert or _has_experts(view)) \
            and arch_key(gf, "expert_used_count") not in gf.kv:
        yield problem("missing-expert-used-count",
                       f"key {arch_key(gf, 'expert_used_count')} is missing")


def check_expert_feed_forward_length_present(gf, view):
    # Mixtral-style `llama` files and llama.cpp's phimoe use feed_forward_length for the
    # experts; for an unknown architecture no one can say which key it needs.
    if view.metadata.known_to_llama_cpp and gf.architecture not in ("llama", "phimoe") \
            and _has_experts(view) \
            and arch_key(gf, "expert_feed_forward_length") not in gf.kv:
        yield problem("missing-expert-feed-forward-length",
                       f"key {arch_key(gf, 'expert_feed_forward_length')} is missing")


def check_expert_count_limit(gf, view):
    n_expert = view.metadata.expert_count
    if n_expert is not None and n_expert > MAX_EXPERTS:
        yield problem("expert-count-over-limit",
                       f"key {arch_key(gf, 'expert_count')} = {n_expert} exceeds llama.cpp's "
                       f"limit of {MAX_EXPERTS}")


def check_expert_used_zero(gf, view):
    n_expert, n_used = view.metadata.expert_count, view.metadata.expert_used_count
    if n_expert and n_used == 0:
        yield problem("expert-used-zero", f"key {arch_key(gf, 'expert_used_count')} = 0 "
                                           f"with {n_expert} experts")


def check_expert_used_not_above_count(gf, view):
    n_expert, n_used = view.metadata.expert_count, view.metadata.expert_used_count
    if n_expert is not None and n_used is not None and n_used > n_expert:
        yield problem("expert-used-gt-count",
                       f"key {arch_key(gf, 'expert_used_count')} = {n_used} exceeds "
                       f"{arch_key(gf, 'expert_count')} = {n_expert}")


def check_nonstandard_names(gf, view):
    for t in gf.tensors:
        canonical = canonical_alias(t.name)
        if canonical:
            yield problem("nonstandard-expert-name",
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
        yield problem("legacy-split-experts",
                       f"layer {layer} stores {len(members)} '{part}' experts as separate tensors "
                       f"(e.g. '{members[0][1].name}'); llama.cpp expects "
                       f"'blk.{layer}.ffn_{part}_exps.weight'")


def check_split_expert_types(gf, view):
    for (layer, part), members in sorted(split_expert_groups(gf).items()):
        types = {t.type_name for _, t in members}
        shapes = {t.shape for _, t in members}
        if len(types) > 1 or len(shapes) > 1:
            yield problem("mixed-expert-types",
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
        yield problem("missing-layer", f"no tensors for {n_missing} layer(s): {shown} "
                                        f"(block_count = {expected})")
    extra = sorted(i for i in present if i >= expected)
    if extra:
        yield problem("missing-layer", f"tensors for layer {extra[0]} beyond "
                                        f"{arch_key(gf, 'block_count')} = {n_blocks}")


def check_router_present(gf, view):
    for layer in view.layers:
        if layer.is_moe and not any(t.name.endswith(".weight") for t in layer.of(ROUTER)):
            yield problem("missing-router", f"layer {layer.index} has expert tensors but no "
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
            yield problem("expert-shape-mismatch",
                           f"tensor '{t.name}' has shape {list(t.shape)} but the metadata "
                           f"(n_embd, expert width, expert_count) says {list(shown)}")


def check_tensor_types(gf, view):
    for t in gf.tensors:
        if t.ggml_type is None:
            yield problem("unknown-tensor-type", f"tensor '{t.name}' has unknown ggml type id "
                                                  f"{t.type_id}")


def check_tensor_shapes(gf, view):
    for t in gf.tensors:
        if not t.shape or 0 in t.shape:
            yield problem("invalid-tensor-shape",
                          f"tensor '{t.name}' has shape {list(t.shape)}: no elements")
        elif t.ggml_type is not None and t.n_bytes < 0:
            yield problem("invalid-tensor-shape",
                           f"tensor '{t.name}' of type {t.type_name} has shape {list(t.shape)}: "
                           "its rows are not a whole number of quant blocks")


def _data_ranges(gf: GGUFFile) -> dict[int, list]:
    """piece -> its aligned tensors, in the order of their data (of unknown size: n_bytes -1)."""
    by_piece: dict[int, list] = defaultdict(list)
    for t in gf.tensors:
        if t.n_bytes and not t.offset % gf.piece_of(t).alignment:  # else misaligned
            by_piece[t.piece].append(t)
    return {piece: sorted(ts, key=lambda t: (t.data_start, t.name)) for piece, ts in by_piece.items()}


def check_data_overlap(gf, view):
    """Two tensors sharing bytes: one at another's offset, or one whose type or shape was
    changed to a larger size."""
    for tensors in _data_ranges(gf).values():
        for before, after in zip(tensors, tensors[1:]):
            if before.n_bytes > 0 and after.data_start < before.data_end:
                yield problem("tensor-data-overlap",
                              f"tensor '{after.name}'{_where(gf, after)} starts at data offset "
                              f"{after.offset}, inside '{before.name}' ({before.type_name} "
                              f"{list(before.shape)}: data offsets {before.offset} to "
                              f"{before.offset + before.n_bytes})")


def check_data_gaps(gf, view):
    """Writers lay tensors out back to back, each padded to the alignment: a larger gap means
    a tensor's type or shape no longer says how many bytes it holds."""
    for tensors in _data_ranges(gf).values():
        for before, after in zip(tensors, tensors[1:]):
            alignment = gf.piece_of(before).alignment
            gap = after.data_start - before.data_end
            if before.n_bytes > 0 and gap >= alignment:
                yield problem("tensor-size-mismatch",
                              f"tensor '{before.name}'{_where(gf, before)} is {before.type_name} "
                              f"{list(before.shape)}, {before.n_bytes} bytes, but the next "
                              f"tensor's data starts {gap} bytes after its end: its type or "
                              "shape does not match its data")


def _where(gf: GGUFFile, t) -> str:
    """Names the piece holding a tensor, in a split set."""
    return f" (in {gf.piece_of(t).path.name})" if gf.pieces else ""


def check_alignment(gf, view):
    for t in gf.tensors:
        alignment = gf.piece_of(t).alignment
        if t.offset % alignment:
            yield problem("misaligned-tensor-offset",
                           f"tensor '{t.name}'{_where(gf, t)} starts at data offset {t.offset}, "
                           f"not a multiple of the alignment {alignment}")


def check_data_in_file(gf, view):
    for t in gf.tensors:
        size = gf.piece_of(t).file_size
        if t.n_bytes >= 0 and t.data_end > size:
            yield problem("tensor-data-past-eof",
                           f"tensor '{t.name}'{_where(gf, t)} needs bytes up to {t.data_end} but "
                           f"the file ends at {size}: the file is truncated")


def check_split_tensor_count(gf, view):
    expected = gf.get(SPLIT_TENSORS)
    if gf.pieces and expected != len(gf.tensors):
        # Worded as llama.cpp's loader words it.
        yield problem("split-tensor-count",
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
            yield problem("split-key-differs",
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
