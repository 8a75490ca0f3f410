"""ModelConfig: the hyperparameters of one model, read from GGUF keys or a HF config.json.

One dataclass for every family; values a family does not use keep their neutral default.
Derived values (head size, attention scale, which layers slide) are filled in ``__post_init__``.
GGUF semantics are the reference: where llama.cpp hard-codes a per-architecture choice
(NeoX RoPE, top-k renormalisation) the ``ARCH_TRAITS`` table says so, and a HF config is
translated into the same fields. ``config_from_gguf`` and ``config_from_hf`` read the keys every
family shares; what one family reads differently is its hook in ``formats.families``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeswap.errors import MoeswapError
from moeswap.formats.families import FAMILIES
from moeswap.formats.rope_scaling import (Yarn, hf_rope_parameters, llama3_factors, yarn_from_gguf,
                                          yarn_from_hf)


@dataclass(frozen=True)
class ArchTraits:
    rope_neox: bool  # rotate (x[i], x[i + d/2]) pairs; otherwise adjacent pairs, as llama.cpp's NORM
    expert_weights_norm: bool  # llama.cpp's default renormalisation of the top-k weights
    swa_pattern: int = 0  # default sliding-window pattern: every n-th layer is global (0: none)
    expert_act: str = "silu"  # routed experts' gated activation: silu | gelu | swiglu_oai (GPT-OSS)
    gating: str = "softmax"  # softmax over all experts, sigmoid per expert, or softmax_topk:
    # top-k logits, then softmax


# llama.cpp's per-architecture constants (llama-model.cpp / src/models/*.cpp).
ARCH_TRAITS = {
    "llama": ArchTraits(rope_neox=False, expert_weights_norm=True),  # Mixtral, Llama, Mistral
    "qwen2moe": ArchTraits(rope_neox=True, expert_weights_norm=False),
    "qwen3moe": ArchTraits(rope_neox=True, expert_weights_norm=True),
    "olmoe": ArchTraits(rope_neox=True, expert_weights_norm=False),
    "granitemoe": ArchTraits(rope_neox=False, expert_weights_norm=True),
    "gemma3": ArchTraits(rope_neox=True, expert_weights_norm=False, swa_pattern=6),
    "deepseek2": ArchTraits(rope_neox=False, expert_weights_norm=False),
    "gpt-oss": ArchTraits(rope_neox=True, expert_weights_norm=False, swa_pattern=2,
                          expert_act="swiglu_oai", gating="softmax_topk"),
    "gemma4": ArchTraits(rope_neox=True, expert_weights_norm=True, swa_pattern=6, expert_act="gelu"),
    "glm4moe": ArchTraits(rope_neox=True, expert_weights_norm=False, gating="sigmoid"),
    "phimoe": ArchTraits(rope_neox=True, expert_weights_norm=True),  # Phi-3.5-MoE
    # Llama 4: 3 chunked-attention (RoPE) layers then 1 full (NoPE); top-k of the logits, each
    # weighted by its sigmoid
    "llama4": ArchTraits(rope_neox=False, expert_weights_norm=False, swa_pattern=4, gating="sigmoid"),
}

# HF ``architectures[0]`` -> GGUF ``general.architecture``.
HF_ARCHITECTURES = {
    "MixtralForCausalLM": "llama",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "OlmoeForCausalLM": "olmoe",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoe",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",  # DeepSeek-V3 / R1, Kimi-K2
    "GptOssForCausalLM": "gpt-oss",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Glm4MoeForCausalLM": "glm4moe",  # GLM-4.5 / 4.5-Air / 4.6
    "PhimoeForCausalLM": "phimoe",  # Phi-3.5-MoE, as transformers saves it
    "PhiMoEForCausalLM": "phimoe",  # ... and as microsoft/Phi-3.5-MoE-instruct publishes it
    "Llama4ForCausalLM": "llama4",  # Llama 4 Scout / Maverick, text part
    "Llama4ForConditionalGeneration": "llama4",
}


@dataclass
class ModelConfig:
    arch: str  # GGUF general.architecture
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int
    rms_eps: float
    n_ff: int = 0  # dense FFN width; 0 when every layer is MoE
    head_dim: int = 0  # 0: n_embd // n_head
    n_rot: int = 0  # rotated dims per head; 0: head_dim
    rope_base: float = 10000.0
    rope_scale: float = 1.0  # linear scaling factor: positions are divided by it
    yarn: Yarn | None = None  # YaRN scaling instead of linear
    rope_base_swa: float = 10000.0  # RoPE base of sliding-window layers
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # shared expert width; 0: none
    expert_weights_norm: bool | None = None  # None: the architecture's default
    expert_weights_scale: float = 1.0
    gating: str = ""  # softmax | sigmoid | softmax_topk | sparsemixer; "": the architecture's
    n_expert_groups: int = 0  # group-limited expert choice (DeepSeek-V3): groups; 0 or 1: none
    n_expert_groups_used: int = 0  # ... and how many of them a token's experts come from
    sliding_window: int = 0  # 0: full attention everywhere
    swa_layers: tuple[bool, ...] = ()  # per layer; () with a window: the architecture's pattern
    attention_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0  # logits are divided by it (Granite)
    final_logit_softcap: float = 0.0
    attn_logit_softcap: float = 0.0
    tied_embeddings: bool = False
    n_layer_dense_lead: int = 0  # leading layers with a dense FFN instead of the MoE block
    n_expert_shared: int = 0  # DeepSeek: shared experts, fused into one FFN n_ff_shexp wide
    q_lora_rank: int = 0  # MLA: query down-projection rank (0: plain attn_q)
    kv_lora_rank: int = 0  # MLA: width of the cached latent; 0 means no MLA
    head_dim_k_mla: int = 0  # MLA: per-head query/key size after decompression (nope + rope)
    head_dim_v_mla: int = 0  # MLA: per-head value size after decompression
    head_dim_swa: int = 0  # Gemma 4: head size of sliding-window layers (0: head_dim)
    n_head_kv_swa: int = 0  # Gemma 4: kv heads of sliding-window layers (0: n_head_kv)
    n_rot_swa: int = 0  # Gemma 4: rotated dims of sliding-window layers (0: head_dim_swa)
    rope_partial: float = 1.0  # Gemma 4 global layers rotate this fraction of the head ("proportional"
    # RoPE); a GGUF carries it as the rope_freqs tensor instead
    n_moe_layer_step: int = 0  # Llama 4: layer i is MoE when (i + 1) % step == 0 (0: every layer)
    no_rope_layers: tuple[bool, ...] = ()  # Llama 4: per layer, True where attention has no RoPE
    chunked_attention: bool = False  # the sliding layers attend within aligned chunks of
    # sliding_window positions (Llama 4), not over a window
    attn_temp_floor: int = 0  # Llama 4's NoPE layers scale q by 1 + attn_temp_scale *
    attn_temp_scale: float = 0.0  # log(floor((pos + 1) / attn_temp_floor) + 1); 0: no scaling
    qk_l2_norm: bool = False  # Llama 4: q and k RMS-normalised (no weight) after RoPE
    rope_mscale: float = 1.0  # cos/sin multiplier without YaRN (Phi-3.5-MoE's LongRoPE)
    rope_factors: tuple[float, ...] = ()  # per rotated pair, dividing its frequency (a HF
    # folder's LongRoPE short_factor or Llama 3 scaling; a GGUF carries rope_factors_short /
    # _long or rope_freqs tensors)
    rope_orig_ctx: int = 0  # LongRoPE: a context beyond it takes the long factors (GGUF)
    layer_norm: bool = False  # norms subtract the mean and add a bias (HF Phi-3.5-MoE)
    router_jitter: float = 0.0  # sparsemixer's relative threshold / 2 (HF Phi-3.5-MoE)
    rope_neox: bool = field(init=False)
    expert_act: str = field(init=False)

    def __post_init__(self) -> None:
        traits = ARCH_TRAITS.get(self.arch)
        if traits is None:
            raise MoeswapError(f"architecture '{self.arch}' is not supported "
                               f"(supported: {', '.join(ARCH_TRAITS)})")
        self.rope_neox = traits.rope_neox
        self.expert_act, self.gating = traits.expert_act, self.gating or traits.gating
        g = self.n_expert_groups
        if g > 1 and not (g < self.n_expert and self.n_expert % g == 0
                          and 0 < self.n_expert_groups_used < g):
            # llama.cpp asserts the same (llama_model::load_hparams)
            raise MoeswapError(f"expert groups: {self.n_expert} experts in {g} groups, "
                               f"{self.n_expert_groups_used} used; llama.cpp requires fewer groups "
                               "than experts, dividing them, and 0 < groups used < groups")
        if self.expert_weights_norm is None:
            self.expert_weights_norm = traits.expert_weights_norm
        if self.head_dim == 0:
            self.head_dim = self.n_embd // self.n_head
        if self.n_rot == 0:
            self.n_rot = self.head_dim
        self.head_dim_swa = self.head_dim_swa or self.head_dim
        self.n_head_kv_swa = self.n_head_kv_swa or self.n_head_kv
        self.n_rot_swa = self.n_rot_swa or self.head_dim_swa
        if self.n_expert_shared and not self.n_ff_shexp:
            self.n_ff_shexp = self.n_ff_exp * self.n_expert_shared
        if self.attention_scale == 0.0:
            self.attention_scale = 1.0 / math.sqrt(self.head_dim)
        if self.sliding_window and not self.swa_layers:
            pattern = traits.swa_pattern
            # llama.cpp's set_swa_pattern: layer i slides unless it is the last of each group
            self.swa_layers = tuple(pattern == 0 or i % pattern < pattern - 1
                                    for i in range(self.n_layer))
        if not self.sliding_window:
            self.swa_layers = (False,) * self.n_layer
        self.swa_layers = tuple(bool(s) for s in self.swa_layers)
        self.no_rope_layers = tuple(bool(n) for n in self.no_rope_layers) or (False,) * self.n_layer

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: full attention): the one source of the attention
        mask's window and the KV cache's ring (moeswap.models)."""
        return tuple(self.sliding_window if swa else 0 for swa in self.swa_layers)

    @property
    def kv_floats_per_token(self) -> int:
        """Numbers the KV cache holds per token over all layers: MLA caches one latent
        (kv_lora_rank + rope dims, no separate values); Gemma 4's layer types differ."""
        if self.kv_lora_rank:
            return self.n_layer * (self.kv_lora_rank + self.n_rot)
        return sum(2 * (self.n_head_kv_swa * self.head_dim_swa if swa else self.n_head_kv * self.head_dim)
                   for swa in self.swa_layers)

    @property
    def kv_floats_per_token_by_kind(self) -> tuple[int, int]:
        """(numbers per token on full-attention layers, on sliding-window layers): the
        sliding ones hold only their window (moeswap.memory.kv_cache_bytes)."""
        if self.kv_lora_rank:  # MLA: every layer caches the latent, none slides
            return self.kv_floats_per_token, 0
        swa = sum(2 * self.n_head_kv_swa * self.head_dim_swa for s in self.swa_layers if s)
        return self.kv_floats_per_token - swa, swa

    @property
    def moe_layers(self) -> list[int]:
        """Layers whose FFN is the MoE block (DeepSeek's leading layers and Llama 4's
        interleaved ones stay dense)."""
        step = self.n_moe_layer_step
        return [i for i in range(self.n_layer_dense_lead, self.n_layer)
                if not step or (i + 1) % step == 0] if self.is_moe else []


# Keys a GGUF may give per layer, accepted when all layers agree (moeswap has one width per
# model); checked after the family's hook, which may split them by layer type first.
_ONE_PER_MODEL = {"n_head_kv_swa": "attention.head_count_kv (sliding)",
                  "n_head_kv": "attention.head_count_kv",
                  "n_ff": "feed_forward_length",
                  "n_ff_exp": "expert_feed_forward_length",
                  "n_expert_used": "expert_used_count"}


def config_from_gguf(gguf_file: Any) -> ModelConfig:
    """ModelConfig from a GGUFFile's metadata, with llama.cpp's defaults for absent keys."""
    arch = gguf_file.architecture
    if arch is None:
        raise MoeswapError(f"{gguf_file.path}: no general.architecture key; "
                           "the file was not written by a llama.cpp-compatible converter")
    if arch not in ARCH_TRAITS:
        raise MoeswapError(f"{gguf_file.path}: architecture '{arch}' is not supported "
                           f"(supported: {', '.join(ARCH_TRAITS)})")

    def key(name: str, default: Any = None) -> Any:
        value = gguf_file.get(f"{arch}.{name}", default)
        if isinstance(value, np.ndarray):
            return value.tolist()
        return value

    def required(name: str) -> Any:
        value = key(name)
        if value is None:
            raise MoeswapError(f"{gguf_file.path}: required key '{arch}.{name}' is missing")
        return value

    embd = gguf_file.tensor("token_embd.weight")
    if embd is None:
        raise MoeswapError(f"{gguf_file.path}: tensor 'token_embd.weight' is missing")
    n_layer = int(required("block_count"))
    n_head = _uniform(gguf_file.path, f"{arch}.attention.head_count", required("attention.head_count"))
    pattern = key("attention.sliding_window_pattern")
    swa_layers: tuple[bool, ...] = ()
    if isinstance(pattern, list):
        swa_layers = tuple(bool(p) for p in pattern)
    elif pattern is not None:
        swa_layers = tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(n_layer))
    scaling_type = key("rope.scaling.type", "linear")
    rope_factor = float(key("rope.scaling.factor", 0.0) or 0.0)
    if scaling_type not in ("none", "linear", "yarn") and rope_factor not in (0.0, 1.0):
        raise MoeswapError(f"{gguf_file.path}: RoPE scaling '{scaling_type}' is not supported "
                           "(supported: none, linear, yarn)")
    yarn = yarn_from_gguf(gguf_file.path, key, arch) if scaling_type == "yarn" else None
    fields = dict(
        arch=arch,
        n_vocab=int(embd.shape[1]),
        n_embd=int(required("embedding_length")),
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=key("attention.head_count_kv", n_head),
        n_ctx_train=int(key("context_length", 0)),
        rms_eps=float(required("attention.layer_norm_rms_epsilon")),
        n_ff=key("feed_forward_length", 0),
        head_dim=int(key("attention.key_length", 0)),
        n_rot=int(key("rope.dimension_count", 0)),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_scale=rope_factor if scaling_type == "linear" and rope_factor else 1.0,
        yarn=yarn,
        rope_base_swa=float(key("rope.freq_base_swa", 10000.0)),
        n_expert=int(key("expert_count", 0)),
        n_expert_used=key("expert_used_count", 0),  # a per-layer array in llama.cpp too
        n_ff_exp=key("expert_feed_forward_length", 0),
        n_ff_shexp=int(key("expert_shared_feed_forward_length", 0)),
        expert_weights_norm=key("expert_weights_norm"),
        expert_weights_scale=float(key("expert_weights_scale", 0.0) or 1.0),
        n_expert_groups=int(key("expert_group_count", 0)),
        n_expert_groups_used=int(key("expert_group_used_count", 0)),
        sliding_window=int(key("attention.sliding_window", 0)),
        swa_layers=swa_layers,
        attention_scale=float(key("attention.scale", 0.0)),
        embedding_scale=float(key("embedding_scale", 0.0) or 1.0),
        residual_scale=float(key("residual_scale", 0.0) or 1.0),
        logit_scale=float(key("logit_scale", 0.0) or 1.0),
        final_logit_softcap=float(key("final_logit_softcapping", 0.0)),
        attn_logit_softcap=float(key("attn_logit_softcapping", 0.0)),
        tied_embeddings=gguf_file.tensor("output.weight") is None,
        n_layer_dense_lead=int(key("leading_dense_block_count", 0)),
        n_expert_shared=int(key("expert_shared_count", 0)),
        q_lora_rank=int(key("attention.q_lora_rank", 0)),
        kv_lora_rank=int(key("attention.kv_lora_rank", 0)),
        head_dim_k_mla=int(key("attention.key_length_mla", 0)),
        head_dim_v_mla=int(key("attention.value_length_mla", 0)),
        head_dim_swa=int(key("attention.key_length_swa", 0)),
        n_head_kv_swa=0,
        n_rot_swa=int(key("rope.dimension_count_swa", 0)),
    )
    FAMILIES[arch].gguf_fields(gguf_file.path, key, fields)
    for name, gguf_key in _ONE_PER_MODEL.items():
        fields[name] = _uniform(gguf_file.path, f"{arch}.{gguf_key}", fields[name])
    return ModelConfig(**fields)


def _uniform(path: Any, name: str, value: Any) -> int:
    """A per-layer array key is accepted when all layers agree; moeswap has one width per model."""
    if isinstance(value, list):
        if len(set(value)) > 1:
            raise MoeswapError(f"{path}: '{name}' differs between layers ({value}); "
                               "per-layer widths are not supported")
        value = value[0]
    return int(value)


class HfConfig(dict):
    """config.json's keys: reading a missing one is a MoeswapError naming it, not a KeyError."""

    def __init__(self, path: Path, items: dict[str, Any]):
        super().__init__(items)
        self.path = path

    def __missing__(self, key: str) -> Any:
        raise MoeswapError(f"{self.path}: required key '{key}' is missing")


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MoeswapError(f"{folder}: no config.json; expected a Hugging Face model folder") from None
    except json.JSONDecodeError as e:
        raise MoeswapError(f"{path}: invalid JSON ({e})") from None
    # Multimodal wrappers (Gemma3ForConditionalGeneration) keep the LM in text_config.
    return HfConfig(path, {**raw, **raw.get("text_config", {}),
                           "architectures": raw.get("architectures", [])})


def hf_arch(hf: dict[str, Any], folder: Path) -> str:
    names = hf.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    raise MoeswapError(f"{folder}/config.json: architectures {names} not supported "
                       f"(supported: {', '.join(HF_ARCHITECTURES)})")


def _rope_factor(params: dict[str, Any], folder: Path) -> float:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return 1.0
    if rope_type == "linear":
        return float(params["factor"])
    if rope_type == "proportional":  # Gemma 4: linear scaling of the rotated part
        return float(params.get("factor", 1.0))
    if rope_type == "yarn":  # not linear: see yarn_from_hf
        return 1.0
    raise MoeswapError(f"{folder}/config.json: RoPE scaling '{rope_type}' is not supported "
                       "(supported: default, linear, proportional, yarn)")


def config_from_hf(folder: str | Path) -> ModelConfig:
    """ModelConfig from a HF folder's config.json, translated into the GGUF semantics."""
    folder = Path(folder)
    hf = read_hf_config(folder)
    arch = hf_arch(hf, folder)
    family = FAMILIES[arch]
    window = hf.get("sliding_window") or 0
    swa_layers: tuple[bool, ...] = ()
    if not family.hf_layer_types:
        window = window if hf.get("use_sliding_window") else 0
    elif hf.get("layer_types"):
        swa_layers = tuple(t == "sliding_attention" for t in hf["layer_types"])
    n_expert = (hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
                or 0)
    fields = dict(
        arch=arch,
        n_vocab=hf["vocab_size"],
        n_embd=hf["hidden_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_head_kv=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        n_ctx_train=hf.get("max_position_embeddings", 0),
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        n_ff=0 if n_expert else hf["intermediate_size"],
        head_dim=hf.get("head_dim") or 0,
        n_expert=n_expert,
        n_expert_used=(hf.get("num_experts_per_tok") or hf.get("top_k_experts") or 0) if n_expert else 0,
        n_ff_exp=hf.get("moe_intermediate_size") or (hf["intermediate_size"] if n_expert else 0),
        n_ff_shexp=hf.get("shared_expert_intermediate_size") or hf.get("shared_intermediate_size") or 0,
        expert_weights_scale=hf.get("routed_scaling_factor") or 1.0,
        n_expert_shared=hf.get("n_shared_experts") or 0,
        sliding_window=window,
        swa_layers=swa_layers,
        residual_scale=hf.get("residual_multiplier") or 1.0,
        logit_scale=hf.get("logits_scaling") or 1.0,
        final_logit_softcap=hf.get("final_logit_softcapping") or 0.0,
        attn_logit_softcap=hf.get("attn_logit_softcapping") or 0.0,
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    family.hf_fields(hf, folder, fields)
    # RoPE after the hook, so that a family refusing its RoPE variant says so in its own words.
    full = hf_rope_parameters(hf, "full_attention")
    if full.get("rope_type") == "llama3":  # Llama 3.1+, Llama 4 Scout: divisors per pair
        fields["rope_factors"] = llama3_factors(
            full, fields["head_dim"] or fields["n_embd"] // fields["n_head"])
    fields.update(
        rope_base=float(full.get("rope_theta", 10000.0)),
        rope_scale=1.0 if fields.get("rope_factors") else _rope_factor(full, folder),
        yarn=yarn_from_hf(full, hf) if full.get("rope_type") == "yarn" else None,
        rope_base_swa=float(hf_rope_parameters(hf, "sliding_attention").get("rope_theta", 10000.0)),
    )
    return ModelConfig(**fields)
