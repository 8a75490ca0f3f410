"""Memory arithmetic: sizes like ``12GiB``, the KV cache, a step's working memory, and the one
sum of what the host budget (``--host-mem``) pays before it holds any routed expert.

Pure arithmetic over a ModelConfig: the engine sizes its caches with it, and the expert store,
`run`, `chat`, `serve`, the benchmark and the planner all charge the budget through
``HostCharge``, so that a new term is one edit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from moeswap.errors import MoeswapError
from moeswap.formats.config import ModelConfig

STEP_TOKENS = 512  # default tokens per forward: llama.cpp's n_ubatch

# Bytes per cached number of each KV cache type (--kv-type): the library's default f32 keeps
# the reference tests exact; the command line's f16 is llama.cpp's default and half the RAM;
# q8_0 is 34 bytes per block of 32 numbers (ggml attention graphs only: heads of 32k numbers).
KV_TYPES = {"f32": 4, "f16": 2, "q8_0": 34 / 32}
COMMAND_KV_TYPE = "f16"  # --kv-type's default (run, chat, serve, plan)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4,
          "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'12GiB', '512MiB', '1.5GB', '4096' -> bytes (a fraction of a byte rounds up). Strict:
    a fraction without a unit ('1.5': of what?) and a negative size are refused."""
    match = re.fullmatch(r"\s*(-?)([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(3).lower() not in _UNITS:
        raise MoeswapError(f"cannot read {text!r} as a size; write e.g. 512MiB, 12GiB or 4096")
    sign, number, unit = match.group(1), match.group(2), match.group(3).lower()
    if sign:
        raise MoeswapError(f"size {text!r} is negative; give 0 or more, e.g. 512MiB or 12GiB")
    if "." in number and not unit:
        raise MoeswapError(f"size {text!r} has a fraction but no unit; give one, e.g. "
                           f"{number}GiB (a bare number counts bytes)")
    return math.ceil(round(float(number) * _UNITS[unit], 6))


def format_size(n_bytes: int) -> str:
    """Bytes for people and for flags: '3.21GiB', '249.01MiB', '12KiB', '512'; never less than
    ``n_bytes`` when read back with parse_size, so a size a message asks for is enough."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n_bytes >= size:
            value = math.ceil(n_bytes * 100 / size) / 100  # two decimals, rounded up
            return f"{value:.2f}".rstrip("0").rstrip(".") + unit
    return str(n_bytes)


def kv_type_bytes(kv_type: str) -> float:
    """Bytes of one cached number of ``kv_type`` ('f32', 'f16', 'q8_0': 1.0625)."""
    if kv_type not in KV_TYPES:
        raise MoeswapError(f"unknown KV cache type {kv_type!r}; use one of {', '.join(KV_TYPES)}")
    return KV_TYPES[kv_type]


def kv_bytes_per_token(config: ModelConfig, kv_type: str = "f32") -> int:
    """Bytes one position costs when every layer keeps it: keys and values of every layer
    (one latent for MLA; per layer type for Gemma 4) in ``kv_type``. Sliding-window layers
    keep only their window: ``kv_cache_bytes`` is what a cache holds."""
    return math.ceil(kv_type_bytes(kv_type) * config.kv_floats_per_token)


def held_positions(window: int, context: int, step_tokens: int = 0) -> int:
    """Positions one layer's cache holds for a sequence of up to ``context`` positions fed at
    most ``step_tokens`` per forward (0: a whole context): every one on a full-attention layer
    (window 0), at most window - 1 + a step's on a sliding-window one (moeswap.models.blocks
    .KVCache sizes its buffers to this)."""
    return min(context, window - 1 + (step_tokens or context)) if window else context


def kv_cache_bytes(config: ModelConfig, context: int, sequences: int = 1,
                   step_tokens: int = 0, kv_type: str = "f32") -> int:
    """Bytes of ``kv_type`` keys and values the caches of ``sequences`` sequences of up to
    ``context`` positions hold, fed at most ``step_tokens`` tokens per forward (0: a whole
    context in one forward): each layer's ``held_positions``."""
    full, swa = config.kv_floats_per_token_by_kind
    held_swa = held_positions(config.sliding_window, context, step_tokens) if swa else 0
    return math.ceil(kv_type_bytes(kv_type) * sequences * (full * context + swa * held_swa))


def kv_widening_bytes(config: ModelConfig, context: int, kv_type: str) -> int:
    """Bytes a step holds to attend over a cache narrower than float32: one layer's kept keys
    and values of one sequence widened to float32 (moeswap.models.blocks.attend), at most
    ``context`` positions of the widest layer; nothing for an f32 cache, nor for a q8_0 one
    (only ggml's flash attention reads it, a row at a time)."""
    if kv_type_bytes(kv_type) != 2:
        return 0
    c = config
    if c.kv_lora_rank:  # MLA: the latent as keys, its first kv_lora_rank numbers as values
        widest = 2 * c.kv_lora_rank + c.n_rot
    else:
        widest = 2 * max(c.n_head_kv * c.head_dim,
                         c.n_head_kv_swa * c.head_dim_swa if any(c.swa_layers) else 0)
    return 4 * context * widest


def forward_working_bytes(config: ModelConfig, step_tokens: int, context: int,
                          sequences: int = 1) -> int:
    """Bytes a forward holds besides weights and caches when it feeds at most ``step_tokens``
    tokens (0: a whole context) of ``sequences`` sequences, no more than their whole
    contexts, each token attending over up to ``context`` positions. Float32: per sequence in
    the step, its last position's logits and their sampled copy 2V (generation asks the model
    for those rows alone, ``forward(..., last_only=True)``); per fed token, one layer's
    attention 2HC (``attend`` peaks at 1.1-1.5 x its [K, G, T, S] scores,
    measured in tests/test_attention_memory.py); and the larger of the activations, about
    16D (residual, norms, q/k/v/o, router), and the expert store's per-token buffers,
    K(3F + D) (gate, up and their product per pick, each pick's output; moeswap.experts.store).
    V vocabulary, H query heads, C context, D model width, K experts per token, F an
    expert's FFN width."""
    c = config
    tokens = min(step_tokens or context, sequences * context)
    activations = max(16 * c.n_embd, c.n_expert_used * (3 * c.n_ff_exp + c.n_embd))
    rows = min(tokens, sequences)  # logits rows: one per sequence fed in the step
    return 4 * (tokens * (2 * c.n_head * context + activations) + rows * 2 * c.n_vocab)


CHARGE_WORDS = {"shared_bytes": "the shared weights", "kv_bytes": "the KV cache",
                "working_bytes": "the working memory of a step",
                "staging_bytes": "the staging slots", "lowbit_bytes": "the --miss-lowbit copies"}


@dataclass(frozen=True)
class HostCharge:
    """What the host budget pays before it holds a routed expert, for ``sequences`` sequences
    of up to ``context_tokens`` positions fed at most ``step_tokens`` tokens per forward (0: a
    whole context): the shared weights, the store's staging slots, any ``--miss-lowbit``
    copies, the KV caches and one step's working memory. ``terms`` is the one place they are
    added up; the store, run, chat, serve, the benchmark and the planner all ask it.
    A charge of no context (the default) charges no cache and no step."""

    context_tokens: int = 0
    sequences: int = 1
    step_tokens: int = 0
    kv_type: str = "f32"  # of the cached keys and values (KV_TYPES)

    @classmethod
    def for_sequence(cls, context_tokens: int, step_tokens: int = 0,
                     kv_type: str = "f32") -> HostCharge:
        """`moeswap run` and `chat`: one sequence's cache."""
        return cls(context_tokens, 1, step_tokens, kv_type)

    @classmethod
    def for_batch(cls, context_tokens: int, sequences: int, step_tokens: int = 0,
                  kv_type: str = "f32") -> HostCharge:
        """`moeswap serve`: every batch slot's cache may fill its context at once."""
        return cls(context_tokens, sequences, step_tokens, kv_type)

    def kv_bytes(self, config: ModelConfig) -> int:
        return kv_cache_bytes(config, self.context_tokens, self.sequences, self.step_tokens,
                              self.kv_type)

    def working_bytes(self, config: ModelConfig) -> int:
        return (forward_working_bytes(config, self.step_tokens, self.context_tokens,
                                      self.sequences)
                + kv_widening_bytes(config, self.context_tokens, self.kv_type))

    def terms(self, config: ModelConfig, shared_bytes: int, staging_bytes: int,
              lowbit_bytes: int = 0) -> dict[str, int]:
        """Each charged term, in bytes, by name (CHARGE_WORDS says them in a message)."""
        return {"shared_bytes": shared_bytes, "kv_bytes": self.kv_bytes(config),
                "working_bytes": self.working_bytes(config), "staging_bytes": staging_bytes,
                "lowbit_bytes": lowbit_bytes}

    def bytes(self, config: ModelConfig, shared_bytes: int, staging_bytes: int,
              lowbit_bytes: int = 0) -> int:
        return sum(self.terms(config, shared_bytes, staging_bytes, lowbit_bytes).values())

    def shortfall(self, host_bytes: int, terms: dict[str, int], slot_bytes: int) -> str:
        """Why ``host_bytes`` cannot hold ``terms`` (this charge's), in human units, and every
        knob that would make it fit."""
        charged = sum(terms.values())
        parts = [f"{CHARGE_WORDS[name]} ({format_size(n)})" for name, n in terms.items() if n]
        fixes = [f"--host-mem {format_size(charged + slot_bytes)} or more"]
        if terms["kv_bytes"]:
            fixes.append(f"a shorter context than {self.context_tokens} positions (--ctx)")
            if self.kv_type == "f32":
                fixes.append("a 16-bit KV cache (--kv-type f16)")
        if self.sequences > 1:
            fixes.append(f"fewer than {self.sequences} sequences at once (--max-batch)")
        if terms["working_bytes"] and self.step_tokens != 1:
            fixes.append(f"fewer tokens per forward than {self.step_tokens or 'a context'} "
                         "(--step-tokens)")
        if terms["lowbit_bytes"]:
            fixes.append("no --miss-lowbit copies")
        listed = f"{', '.join(parts[:-1])} and {parts[-1]}" if len(parts) > 1 else parts[0]
        return (f"--host-mem {format_size(host_bytes)} is below {listed}, which stay in RAM. "
                "Give " + "; or ".join(fixes))
