"""The Mixture-of-Experts view of a GGUF file: metadata, tensor roles, byte totals.

Built from a ``GGUFFile`` (header and tensor index only; no tensor data is read). The same
name tables serve ``inspect``, ``doctor``, ``fix`` and the runtime's per-(layer, expert)
addressing, so a tensor is classified in exactly one place.

Shapes are in GGUF ``ne`` order (ne0 first). Letters: D n_embd, F expert FFN width,
E n_expert, V vocabulary size.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import gguf
from gguf import GGUFValueType

from moeswap.formats.gguf_file import GGUFFile, TensorInfo

# llama.cpp's `llama_expert_gating_func_type`.
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}

# Per-architecture keys (`{arch}.<suffix>`) and the exact value type llama.cpp's loader demands.
U32, F32, BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
ARCH_KEY_TYPES: dict[str, GGUFValueType] = {
    "block_count": U32, "context_length": U32, "embedding_length": U32,
    "feed_forward_length": U32, "vocab_size": U32,
    "attention.head_count": U32, "attention.head_count_kv": U32,
    "attention.key_length": U32, "attention.value_length": U32,
    "attention.sliding_window": U32, "attention.kv_lora_rank": U32, "attention.q_lora_rank": U32,
    "rope.dimension_count": U32,
    "expert_count": U32, "expert_used_count": U32, "expert_shared_count": U32,
    "expert_feed_forward_length": U32, "expert_shared_feed_forward_length": U32,
    "leading_dense_block_count": U32, "interleave_moe_layer_step": U32, "nextn_predict_layers": U32,
    "expert_group_count": U32, "expert_group_used_count": U32, "expert_gating_func": U32,
    "expert_weights_scale": F32, "expert_weights_norm": BOOL,
    "attention.layer_norm_rms_epsilon": F32, "attention.layer_norm_epsilon": F32,
    "rope.freq_base": F32,
}
# llama.cpp reads these as a scalar or as a per-layer array of i32/u32 (`get_key_or_arr` in
# llama-model.cpp); every other key of ARCH_KEY_TYPES with `get_key`, which refuses an array.
PER_LAYER_ARRAY_KEYS = frozenset({"feed_forward_length", "attention.head_count",
                                  "attention.head_count_kv", "expert_used_count",
                                  "expert_feed_forward_length"})

MAX_EXPERTS = 512  # LLAMA_MAX_EXPERTS: llama.cpp aborts above it

# Roles of tensors.
ROUTER, ROUTED, SHARED_EXPERT = "router", "routed_expert", "shared_expert"
ATTENTION, NORM, DENSE_FFN = "attention", "norm", "dense_ffn"
EMBEDDING, OUTPUT, OTHER = "embedding", "output", "other"

# llama.cpp's canonical per-layer tensor bases (`blk.N.<base>.<kind>`): base -> (role, part).
# `part` names the projection of an expert tensor.
CANONICAL_LAYER_TENSORS: dict[str, tuple[str, str | None]] = {
    "ffn_gate_inp": (ROUTER, None),         # {D, E} router; gpt-oss .bias {E}, gemma4 .scale {D}
    "exp_probs_b": (ROUTER, None),          # {E} selection bias (deepseek-v3 style)
    "ffn_gate_exps": (ROUTED, "gate"),      # {D, F, E}; gpt-oss .bias {F, E}
    "ffn_up_exps": (ROUTED, "up"),          # {D, F, E}
    "ffn_down_exps": (ROUTED, "down"),      # {F, D, E}; gemma4 .scale {E}
    "ffn_gate_up_exps": (ROUTED, "gate_up"),  # {D, 2F, E}, gate rows first
    "ffn_gate_shexp": (SHARED_EXPERT, "gate"),
    "ffn_up_shexp": (SHARED_EXPERT, "up"),
    "ffn_down_shexp": (SHARED_EXPERT, "down"),
    "ffn_gate_inp_shexp": (SHARED_EXPERT, None),  # {D} sigmoid gate of the shared expert (qwen2moe)
    "ffn_gate": (DENSE_FFN, "gate"),
    "ffn_up": (DENSE_FFN, "up"),
    "ffn_down": (DENSE_FFN, "down"),
}
CANONICAL_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": EMBEDDING, "per_layer_token_embd": EMBEDDING,
    "output": OUTPUT, "output_norm": NORM,
}
EXPERT_BASE = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps",
               "gate_up": "ffn_gate_up_exps"}

# Stacked expert tensors under names other tools wrote; llama.cpp finds none of them.
EXPERT_BASE_ALIASES: dict[str, str] = {
    "ffn_gate_experts": "ffn_gate_exps",      # early community converters
    "ffn_up_experts": "ffn_up_exps",
    "ffn_down_experts": "ffn_down_exps",
    "ffn_gate_up_experts": "ffn_gate_up_exps",
    "ffn_gate_moe": "ffn_gate_exps",          # "_moe" suffix variants
    "ffn_up_moe": "ffn_up_exps",
    "ffn_down_moe": "ffn_down_exps",
    "ffn_gate_exp": "ffn_gate_exps",          # singular typo
    "ffn_up_exp": "ffn_up_exps",
    "ffn_down_exp": "ffn_down_exps",
    "router": "ffn_gate_inp",                 # hand-written exporters
    "ffn_router": "ffn_gate_inp",
}
# One expert per tensor: (regex over the full name -> layer, part, expert). The first is the
# legacy layout early Mixtral GGUFs used; current llama.cpp loads none of them.
SPLIT_EXPERT_PATTERNS: tuple[re.Pattern, ...] = (
    re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)\.(?P<expert>\d+)\.weight$"),
    re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)_expert_(?P<expert>\d+)\.weight$"),
    re.compile(r"^blk\.(?P<layer>\d+)\.ffn_expert_(?P<expert>\d+)[._]"
               r"(?P<part>gate|up|down)\.weight$"),
)
_LAYER_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<base>[A-Za-z0-9_.]+?)"
                         r"(?:\.(?P<kind>weight|bias|scale))?$")


@dataclass(frozen=True)
class TensorRole:
    role: str
    layer: int | None = None
    part: str | None = None  # gate / up / down / gate_up for expert and FFN tensors
    kind: str = "weight"  # weight / bias / scale


@dataclass(frozen=True)
class SplitExpert:
    """One tensor of a one-expert-per-tensor layout, e.g. legacy ``blk.3.ffn_up.5.weight``."""

    layer: int
    part: str
    expert: int


def split_expert(name: str) -> SplitExpert | None:
    for pattern in SPLIT_EXPERT_PATTERNS:
        m = pattern.match(name)
        if m:
            return SplitExpert(int(m["layer"]), m["part"], int(m["expert"]))
    return None


def canonical_alias(name: str) -> str | None:
    """llama.cpp's name for a tensor stored under a known non-standard name, else None."""
    m = _LAYER_NAME.match(name)
    if not m or m["base"] not in EXPERT_BASE_ALIASES:
        return None
    return f"blk.{m['layer']}.{EXPERT_BASE_ALIASES[m['base']]}.{m['kind'] or 'weight'}"


def classify(name: str) -> TensorRole:
    """The role of a tensor under llama.cpp's canonical names (aliases are classified as the
    tensor they stand for, split experts as routed experts)."""
    split = split_expert(name)
    if split:
        return TensorRole(ROUTED, split.layer, split.part)
    name = canonical_alias(name) or name
    m = _LAYER_NAME.match(name)
    if m is None:
        base, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias", "scale"):
            base, kind = name, "weight"
        return TensorRole(CANONICAL_GLOBAL_TENSORS.get(base, OTHER), None, None, kind)
    layer, base, kind = int(m["layer"]), m["base"], m["kind"] or "weight"
    if base in CANONICAL_LAYER_TENSORS:
        role, part = CANONICAL_LAYER_TENSORS[base]
        return TensorRole(role, layer, part, kind)
    if "norm" in base:
        return TensorRole(NORM, layer, None, kind)
    if base.startswith("attn"):
        return TensorRole(ATTENTION, layer, None, kind)
    return TensorRole(OTHER, layer, None, kind)


def expert_byte_span(info: TensorInfo, expert: int, n_expert: int) -> tuple[int, int]:
    """(absolute file offset, length) of one expert's slice of a stacked expert tensor.

    The expert index is the outermost dimension, so each expert's bytes are contiguous."""
    per_expert = info.n_bytes // n_expert
    return info.data_start + expert * per_expert, per_expert


@dataclass(frozen=True)
class MoEMetadata:
    architecture: str | None
    known_to_llama_cpp: bool  # per the installed gguf package's MODEL_ARCH_NAMES
    block_count: int | None
    n_embd: int | None
    expert_count: int | None
    expert_used_count: int | None
    expert_shared_count: int | None
    expert_feed_forward_length: int | None
    expert_shared_feed_forward_length: int | None
    leading_dense_block_count: int | None
    expert_gating_func: int | None
    expert_weights_scale: float | None
    expert_weights_norm: bool | None
    nextn_predict_layers: int | None = None  # GLM-4.5's MTP layers, last in block_count

    @property
    def gating_func_name(self) -> str | None:
        if self.expert_gating_func is None:
            return None
        return GATING_FUNCS.get(self.expert_gating_func, f"unknown({self.expert_gating_func})")


def arch_key(gf: GGUFFile, suffix: str) -> str:
    return f"{gf.architecture or '?'}.{suffix}"


def _int_value(gf: GGUFFile, suffix: str) -> int | None:
    value = gf.get(arch_key(gf, suffix))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_metadata(gf: GGUFFile) -> MoEMetadata:
    """The MoE-relevant keys, tolerant of wrong types (doctor reports those): a value of the
    wrong Python kind reads as absent."""
    arch = gf.architecture
    scale = gf.get(arch_key(gf, "expert_weights_scale"))
    norm = gf.get(arch_key(gf, "expert_weights_norm"))
    return MoEMetadata(
        architecture=arch,
        known_to_llama_cpp=arch in gguf.MODEL_ARCH_NAMES.values(),
        block_count=_int_value(gf, "block_count"),
        n_embd=_int_value(gf, "embedding_length"),
        expert_count=_int_value(gf, "expert_count"),
        expert_used_count=_int_value(gf, "expert_used_count"),
        expert_shared_count=_int_value(gf, "expert_shared_count"),
        expert_feed_forward_length=_int_value(gf, "expert_feed_forward_length"),
        expert_shared_feed_forward_length=_int_value(gf, "expert_shared_feed_forward_length"),
        leading_dense_block_count=_int_value(gf, "leading_dense_block_count"),
        expert_gating_func=_int_value(gf, "expert_gating_func"),
        expert_weights_scale=(float(scale) if isinstance(scale, (int, float))
                              and not isinstance(scale, bool) else None),
        expert_weights_norm=norm if isinstance(norm, bool) else None,
        nextn_predict_layers=_int_value(gf, "nextn_predict_layers"),
    )


@dataclass
class LayerView:
    index: int
    tensors: dict[str, list[TensorInfo]] = field(default_factory=dict)  # role -> tensors

    def of(self, role: str) -> list[TensorInfo]:
        return self.tensors.get(role, [])

    def bytes_of(self, role: str) -> int:
        return sum(max(t.n_bytes, 0) for t in self.of(role))

    @property
    def is_moe(self) -> bool:
        return bool(self.of(ROUTED))


@dataclass(frozen=True)
class ByteTotals:
    total: int
    shared: int  # everything but routed experts: attention, norms, routers, shared experts, ...
    routed: int
    one_expert: int  # one routed expert of one layer (the largest layer's)
    active_per_token: int  # shared weights read per token + top-k experts of every MoE layer


class MoEView:
    """Metadata, per-layer tensor roles and byte totals of one GGUF file."""

    def __init__(self, gf: GGUFFile, n_layer: int | None = None):
        """n_layer: the layers the model runs; tensors of later ones (GLM-4.5's MTP layers,
        which llama.cpp does not load) are left out of ``tensors``, the layers and the totals."""
        self.file = gf
        self.metadata = read_metadata(gf)
        self.roles: dict[str, TensorRole] = {t.name: classify(t.name) for t in gf.tensors}
        self.tensors = [t for t in gf.tensors if n_layer is None
                        or self.roles[t.name].layer is None or self.roles[t.name].layer < n_layer]
        self.global_tensors: dict[str, list[TensorInfo]] = {}
        layers: dict[int, LayerView] = {}
        for t in self.tensors:
            role = self.roles[t.name]
            if role.layer is None:
                self.global_tensors.setdefault(role.role, []).append(t)
            else:
                layer = layers.setdefault(role.layer, LayerView(role.layer))
                layer.tensors.setdefault(role.role, []).append(t)
        self.layers = [layers[i] for i in sorted(layers)]

    @property
    def is_moe(self) -> bool:
        return any(layer.is_moe for layer in self.layers) or bool(self.metadata.expert_count)

    def layer(self, index: int) -> LayerView | None:
        return next((layer for layer in self.layers if layer.index == index), None)

    def expert_tensor(self, layer: int, part: str, kind: str = "weight") -> TensorInfo | None:
        """The stacked tensor of one expert projection under llama.cpp's canonical name."""
        return self.file.tensor(f"blk.{layer}.{EXPERT_BASE[part]}.{kind}")

    def expert_count_from_shapes(self) -> int | None:
        """n_expert as the stacked expert tensors or routers state it (their last dimension)."""
        for layer in self.layers:
            for t in layer.of(ROUTED) + layer.of(ROUTER):
                role = self.roles[t.name]
                if role.kind == "weight" and split_expert(t.name) is None and len(t.shape) >= 2:
                    return t.shape[-1]
        return None

    def expert_width_from_shapes(self) -> int | None:
        """n_ff_exp: ne1 of gate/up {D, F(, E)}, ne0 of down {F, D(, E)}, half ne1 of gate_up;
        stacked and one-expert-per-tensor layouts alike."""
        for layer in self.layers:
            for t in layer.of(ROUTED):
                role = self.roles[t.name]
                if role.kind != "weight" or len(t.shape) < 2:
                    continue
                if role.part in ("gate", "up"):
                    return t.shape[1]
                if role.part == "down":
                    return t.shape[0]
                return t.shape[1] // 2
        return None

    @property
    def expert_width(self) -> int | None:
        """n_ff_exp: the key, else Mixtral-style `llama`'s feed_forward_length, else the shapes."""
        if self.metadata.expert_feed_forward_length is not None:
            return self.metadata.expert_feed_forward_length
        if self.metadata.architecture == "llama" and self.is_moe:
            n_ff = _int_value(self.file, "feed_forward_length")
            if n_ff is not None:
                return n_ff
        return self.expert_width_from_shapes()

    def _n_expert(self) -> int:
        return self.metadata.expert_count or self.expert_count_from_shapes() or 0

    def expert_bytes(self, layer: LayerView) -> int:
        """Bytes of one routed expert of this layer: its slice of every routed tensor."""
        n_expert = self._n_expert()
        routed = layer.bytes_of(ROUTED)
        return routed // n_expert if n_expert else 0

    def totals(self) -> ByteTotals:
        total = sum(max(t.n_bytes, 0) for t in self.tensors)
        routed = sum(layer.bytes_of(ROUTED) for layer in self.layers)
        expert_sizes = [self.expert_bytes(layer) for layer in self.layers if layer.is_moe]
        n_used = self.metadata.expert_used_count or 0
        active = total - routed + n_used * sum(expert_sizes) - self._embedding_bytes_not_read()
        return ByteTotals(total, total - routed, routed, max(expert_sizes, default=0), active)

    def _embedding_bytes_not_read(self) -> int:
        """Bytes of embedding tables a token does not read: all rows but its own, unless the
        output head is tied to token_embd (then the whole table is read for the logits)."""
        tied = "output.weight" not in self.roles
        skipped = 0
        for t in self.global_tensors.get(EMBEDDING, []):
            if t.n_bytes <= 0 or len(t.shape) < 2 or (tied and t.name == "token_embd.weight"):
                continue
            rows = t.shape[-1]  # {D, V}: one row per token
            skipped += t.n_bytes - t.n_bytes // rows
        return skipped

    def type_mix(self) -> dict[str, tuple[int, int]]:
        """ggml type name -> (tensor count, bytes), largest first."""
        counts = Counter(t.type_name for t in self.file.tensors)
        sizes = Counter()
        for t in self.file.tensors:
            sizes[t.type_name] += max(t.n_bytes, 0)
        return {name: (counts[name], sizes[name]) for name, _ in sizes.most_common()}
