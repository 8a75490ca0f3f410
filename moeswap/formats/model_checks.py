"""Checks that a GGUF file describes a model that can be built and run: the tensors every layer
needs (each family's ``FamilyHooks.gguf_layer_tensors``), hyperparameters that fit together, a
usable vocabulary, finite values in the small tensors (norms, routers, biases, scales), and
tensor shapes that fit the configuration (the loader's own shape check).
Each check yields problems (rule id, message);
``formats.validation`` puts them in its table.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType

from moeswap.errors import MoeswapError
from moeswap.formats.families import FAMILIES
from moeswap.formats.file_checks import problem
from moeswap.formats.gguf_file import GGUFFile, StringArray
from moeswap.formats.gguf_moe import ROUTER, arch_key, canonical_alias, split_expert
from moeswap.formats.tensor_shapes import check_shapes

# The vocabularies moeswap.tokenizer reads (tokenizer.ggml.model).
TOKENIZER_MODELS = ("llama", "gpt2", "gemma4")

# ggml float types by (numpy view, exponent mask): all exponent bits set is Inf or NaN.
_FLOAT_BITS = {GGMLQuantizationType.F32: ("<u4", 0x7F80_0000),
               GGMLQuantizationType.F16: ("<u2", 0x7C00),
               GGMLQuantizationType.BF16: ("<u2", 0x7F80)}
_SMALL_TENSOR = 1 << 24  # elements: routers of the largest models are ~2M


def _number(gf: GGUFFile, suffix: str) -> Any:
    """A key's number, a list of numbers for an array, or None when absent or not numeric."""
    value = gf.get(arch_key(gf, suffix))
    if isinstance(value, np.ndarray) and value.dtype.kind in "iuf":
        return value.tolist()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def _per_layer(value: Any) -> list:
    return value if isinstance(value, list) else [value]


# --- tensors ------------------------------------------------------------------------------

def _layer_bases(gf: GGUFFile) -> dict[int, set[str]]:
    """layer -> the canonical bases of its tensors (blk.N.<base>.weight); one-expert-per-tensor
    layouts count as the stack they would make."""
    bases: dict[int, set[str]] = {}
    for t in gf.tensors:
        split = split_expert(t.name)
        if split:
            bases.setdefault(split.layer, set()).add(f"ffn_{split.part}_exps")
            continue
        name = canonical_alias(t.name) or t.name
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
            bases.setdefault(int(parts[1]), set()).add(".".join(parts[2:-1]) or parts[2])
    return bases


def check_required_tensors(gf, view):
    family = FAMILIES.get(gf.architecture)
    if family is None:  # an architecture moeswap does not build: llama.cpp's own list applies
        return
    for name in ("token_embd.weight", "output_norm.weight"):
        if gf.tensor(name) is None:
            yield problem("missing-tensor", f"tensor '{name}' is missing")
    n_blocks = view.metadata.block_count or 0
    n_run = n_blocks - (view.metadata.nextn_predict_layers or 0)  # GLM-4.5's MTP layers aside
    for layer, bases in sorted(_layer_bases(gf).items()):
        if layer >= n_run:
            continue
        for choices in family.gguf_layer_tensors:
            if not bases.intersection(choices):
                names = " or ".join(f"'blk.{layer}.{base}.weight'" for base in choices)
                yield problem("missing-tensor", f"layer {layer} has no {names}")


def _float_words(gf: GGUFFile, t) -> np.ndarray | None:
    if t.ggml_type not in _FLOAT_BITS or t.n_bytes <= 0 or t.data_end > gf.piece_of(t).file_size:
        return None
    dtype, _ = _FLOAT_BITS[t.ggml_type]
    return np.frombuffer(gf.tensor_bytes(t), dtype=dtype)


def _is_small(view, t) -> bool:
    role = view.roles[t.name]
    return t.n_elements <= _SMALL_TENSOR and (
        len(t.shape) == 1 or role.role == ROUTER or role.kind != "weight" or "norm" in t.name)


def check_finite_values(gf, view):
    """NaN or Inf in a norm, router, bias or scale poisons every token; these are small enough
    to scan at load time. Needs the data: skipped on a header fix plans (no buffer)."""
    if gf.buffer is None:
        return
    for t in gf.tensors:
        if not _is_small(view, t):
            continue
        words = _float_words(gf, t)
        if words is None:
            continue
        mask = _FLOAT_BITS[t.ggml_type][1]
        bad = np.count_nonzero((words & mask) == mask)
        if bad:
            yield problem("non-finite-values",
                          f"tensor '{t.name}' holds {bad} NaN or infinite value(s)")


def check_tensor_fit(gf, view):
    """The loader's shape check (formats.tensor_shapes) over the configuration the keys give:
    run only on a file whose structure passed, as the configuration sizes per-layer tables by
    block_count. A configuration moeswap cannot build is the loader's to refuse, in its words."""
    from moeswap.formats.config import config_from_gguf

    if gf.architecture not in FAMILIES:
        return
    try:
        config = config_from_gguf(gf)
    except Exception:  # noqa: BLE001 - any reason: the loader reports it, naming the file
        return
    try:
        check_shapes("", config, (t.name for t in gf.tensors),
                     lambda name: tuple(reversed(gf.tensor(name).shape)))
    except MoeswapError as e:
        yield problem("tensor-shape-mismatch", str(e).removeprefix(": "))


# --- hyperparameters ----------------------------------------------------------------------

def check_hyperparameters(gf, view):
    if gf.architecture is None:
        return
    n_embd = _number(gf, "embedding_length")
    if n_embd is not None and not (isinstance(n_embd, int) and n_embd > 0):
        yield problem("bad-hyperparameter", f"key {arch_key(gf, 'embedding_length')} = {n_embd}: "
                                            "must be > 0")
    heads = _number(gf, "attention.head_count")
    kv_heads = _number(gf, "attention.head_count_kv")
    yield from _check_heads(gf, heads, kv_heads)
    if heads is None or not all(isinstance(h, int) and h > 0 for h in _per_layer(heads)):
        return
    yield from _check_head_size(gf, n_embd, max(_per_layer(heads)))


def _check_heads(gf, heads, kv_heads) -> Iterator:
    head_key, kv_key = arch_key(gf, "attention.head_count"), arch_key(gf, "attention.head_count_kv")
    if heads is None:
        return
    if any(not isinstance(h, int) or h <= 0 for h in _per_layer(heads)):
        yield problem("bad-hyperparameter", f"key {head_key} = {_short(heads)}: every layer needs "
                                            "at least one attention head")
        return
    if kv_heads is None:
        return
    head_list, kv_list = _per_layer(heads), _per_layer(kv_heads)
    n = max(len(head_list), len(kv_list))  # a scalar stands for every layer
    head_list, kv_list = (v * n if len(v) == 1 else v for v in (head_list, kv_list))
    if any(not isinstance(k, int) or k <= 0 for k in kv_list):
        yield problem("bad-hyperparameter", f"key {kv_key} = {_short(kv_heads)}: must be > 0")
    elif any(h % k for h, k in zip(head_list, kv_list)):
        yield problem("bad-hyperparameter", f"key {kv_key} = {_short(kv_heads)} does not divide "
                                            f"{head_key} = {_short(heads)}")


def _check_head_size(gf, n_embd, n_head: int) -> Iterator:
    key_length = _number(gf, "attention.key_length")
    if key_length is None:
        if isinstance(n_embd, int) and n_embd % n_head:
            yield problem("bad-hyperparameter",
                          f"key {arch_key(gf, 'embedding_length')} = {n_embd} is not a multiple "
                          f"of {arch_key(gf, 'attention.head_count')} = {n_head}, and no "
                          f"{arch_key(gf, 'attention.key_length')} gives the head size")
            return
        key_length = n_embd // n_head if isinstance(n_embd, int) else None
    for rope, size in (("rope.dimension_count", key_length),
                       ("rope.dimension_count_swa", _number(gf, "attention.key_length_swa"))):
        dims = _number(gf, rope)
        if isinstance(dims, int) and isinstance(size, int) and dims > size:
            yield problem("bad-hyperparameter", f"key {arch_key(gf, rope)} = {dims} rotates more "
                                                f"than the head size {size}")


# (key, smallest value allowed, whether the smallest is allowed)
_POSITIVE_FLOATS = (("rope.freq_base", 0.0, False), ("rope.freq_base_swa", 0.0, False),
                    ("rope.scaling.factor", 0.0, True),
                    ("attention.layer_norm_rms_epsilon", 0.0, True),
                    ("attention.layer_norm_epsilon", 0.0, True),
                    ("expert_weights_scale", 0.0, True))


def check_float_keys(gf, view):
    """RoPE bases and scales, norm epsilons: finite, and positive where a 0 divides."""
    if gf.architecture is None:
        return
    for suffix, low, low_ok in _POSITIVE_FLOATS:
        value = _number(gf, suffix)
        if value is None or isinstance(value, list):
            continue
        if not math.isfinite(value) or value < low or (value == low and not low_ok):
            bound = ">= 0" if low_ok else "> 0"
            yield problem("bad-hyperparameter",
                          f"key {arch_key(gf, suffix)} = {value}: must be finite and {bound}")


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- vocabulary ---------------------------------------------------------------------------

def _invalid_utf8(tokens: StringArray, end: int) -> int | None:
    """Index of the first token that is not valid UTF-8, else None; ``end``: where the
    array's bytes end in the file."""
    try:  # at once: length prefixes under 128 are ASCII, which ends no UTF-8 sequence
        bytes(tokens.buffer[tokens.start:end]).decode("utf-8")
        return None
    except UnicodeDecodeError:
        pass  # an invalid token, or a prefix of 128 or more: find which, token by token
    offset = tokens.start
    for index in range(tokens.count):
        (length,) = struct.unpack_from("<Q", tokens.buffer, offset)
        try:
            bytes(tokens.buffer[offset + 8: offset + 8 + length]).decode("utf-8")
        except UnicodeDecodeError:
            return index
        offset += 8 + length
    return None


def check_vocabulary(gf, view):
    if gf.architecture not in FAMILIES:
        return
    model = gf.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        yield problem("bad-tokenizer", f"key tokenizer.ggml.model is {model!r}; moeswap reads "
                                       f"{', '.join(map(repr, TOKENIZER_MODELS))}")
    tokens = gf.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, StringArray) or len(tokens) == 0:
        yield problem("bad-tokenizer", "key tokenizer.ggml.tokens is missing, empty or not an "
                                       "array of strings")
        return
    embd = gf.tensor("token_embd.weight")
    rows = embd.shape[-1] if embd is not None and len(embd.shape) == 2 else None
    if rows is not None and rows != len(tokens):
        yield problem("bad-tokenizer", f"tokenizer.ggml.tokens holds {len(tokens)} tokens but "
                                       f"'token_embd.weight' has shape {list(embd.shape)}: "
                                       f"{rows} rows")
    bad = _invalid_utf8(tokens, gf.kv["tokenizer.ggml.tokens"].end)
    if bad is not None:
        yield problem("bad-tokenizer", f"token {bad} of tokenizer.ggml.tokens is not valid UTF-8")
    for key, kind in (("scores", "f"), ("token_type", "iu")):
        value = gf.get(f"tokenizer.ggml.{key}")
        if value is not None and not (isinstance(value, np.ndarray) and value.dtype.kind in kind
                                      and len(value) == len(tokens)):
            yield problem("bad-tokenizer", f"key tokenizer.ggml.{key} does not hold one number "
                                           f"per token ({len(tokens)})")
    if model == "gpt2" and not isinstance(gf.get("tokenizer.ggml.merges"), StringArray):
        yield problem("bad-tokenizer", "a 'gpt2' vocabulary without tokenizer.ggml.merges")
    template = gf.kv.get("tokenizer.chat_template")
    if template is not None and not isinstance(template.value, str):
        yield problem("bad-tokenizer", f"key tokenizer.chat_template has type "
                                       f"{template.type_name}, expected str")
