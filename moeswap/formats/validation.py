"""One validation of a GGUF file, shared by ``moeswap doctor`` and the loader: the table of
rules, each a small check (``formats.file_checks`` over the header and tensor index,
``formats.model_checks`` over what a model needs), and ``refuse_invalid``, which the loader
calls so that ``run``, ``chat`` and ``serve`` refuse what doctor reports as an error.

docs/GGUF.md ("What is validated") lists the rules.
"""

from __future__ import annotations

from moeswap.errors import MoeswapError
from moeswap.formats.file_checks import (
    check_alignment, check_architecture, check_data_gaps, check_data_in_file,
    check_data_overlap, check_duplicate_keys, check_duplicate_tensors,
    check_expert_count_limit, check_expert_count_present, check_expert_feed_forward_length_present,
    check_expert_shapes, check_expert_used_count_present, check_expert_used_not_above_count,
    check_expert_used_zero, check_key_types, check_known_architecture, check_layer_sequence,
    check_nonstandard_names, check_per_layer_arrays, check_required_keys, check_router_present,
    check_split_expert_types, check_split_experts, check_split_keys_agree,
    check_split_tensor_count, check_tensor_shapes, check_tensor_types,
)
from moeswap.formats.findings import ERROR, WARNING, Finding, Rule
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_moe import MoEView
from moeswap.formats.model_checks import (
    check_finite_values, check_float_keys, check_hyperparameters, check_tensor_fit,
    check_required_tensors, check_vocabulary,
)

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
         "a dimension of 0, or rows not a whole number of quant blocks",
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
    Rule("tensor-data-overlap", ERROR, check_data_overlap,
         "two tensors' data share bytes (one offset twice, or a type or shape made larger)",
         _REREAD),
    Rule("tensor-size-mismatch", ERROR, check_data_gaps,
         "a tensor's type and shape say fewer bytes than its data holds (a changed type)",
         _REREAD),
    Rule("per-layer-array-length", ERROR, check_per_layer_arrays,
         "a per-layer array key without one entry per block", _REREAD),
    Rule("missing-tensor", ERROR, check_required_tensors,
         "token_embd, output_norm, or a layer's norm, attention or FFN tensor is absent",
         _REREAD),
    Rule("bad-hyperparameter", ERROR, check_hyperparameters,
         "head counts that are 0 or do not divide, RoPE wider than a head, a RoPE base or norm "
         "epsilon that is not finite and positive", "moeswap fix --set KEY=VALUE, or re-convert"),
    Rule("bad-tokenizer", ERROR, check_vocabulary,
         "a tokenizer model moeswap does not read, a vocabulary that is missing, empty, not "
         "UTF-8 or not one token per embedding row, or a chat template that is not text",
         "re-convert with llama.cpp's convert_hf_to_gguf.py"),
    # Only on a file with no error above (check()): they read tensor data or build the config.
    Rule("non-finite-values", ERROR, check_finite_values,
         "NaN or Inf in a norm, router, bias or scale tensor", _REREAD),
    Rule("tensor-shape-mismatch", ERROR, check_tensor_fit,
         "a tensor whose shape does not fit the model the keys describe (n_embd, heads, "
         "experts), as the loader checks it", _REREAD),
)
RULES_BY_ID = {rule.id: rule for rule in RULES}

# Checks that read tensor data or build the configuration: run only when every other rule
# found no error, so that they read only ranges known to lie in the file and size tables by a
# block_count the layers present agree with.
_AFTER_STRUCTURE = frozenset({"non-finite-values", "tensor-shape-mismatch"})
# More checks under one rule id (the table keeps one row per id).
_EXTRA_CHECKS = {"bad-hyperparameter": (check_float_keys,)}


def check(gf: GGUFFile) -> list[Finding]:
    """Every finding of every rule on ``gf``, fix hints naming the file's own keys."""
    view = MoEView(gf)
    first = [f for rule in RULES if rule.check and rule.id not in _AFTER_STRUCTURE
             for f in _run(rule, gf, view)]
    later = [] if any(f.severity == ERROR for f in first) else [
        f for rule in RULES if rule.id in _AFTER_STRUCTURE for f in _run(rule, gf, view)]
    return first + later


def _run(rule: Rule, gf: GGUFFile, view: MoEView) -> list[Finding]:
    fix = rule.fix.replace("{arch}", gf.architecture) if gf.architecture else rule.fix
    checks = (rule.check, *_EXTRA_CHECKS.get(rule.id, ()))
    return [Finding(rule.id, rule.severity, message, fix)
            for one in checks for _, message in one(gf, view)]


def refuse_invalid(gf: GGUFFile) -> None:
    """Raise a one-line MoeswapError for the first error-severity finding (the loader's gate;
    ``--force`` skips it)."""
    errors = [f for f in check(gf) if f.severity == ERROR]
    if errors:
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise MoeswapError(f"{gf.path}: {errors[0].message} [{errors[0].rule}]{more}; "
                           f"{errors[0].fix}. `moeswap doctor {gf.path}` lists every problem; "
                           "--force loads it anyway")

