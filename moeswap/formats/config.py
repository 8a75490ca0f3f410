"""ModelConfig: the hyperparameters of one model, read from GGUF keys or a HF config.json.

One dataclass for every family; values a family does not use keep their neutral default.
Derived values (head size, attention scale, which layers slide) are filled in ``__post_init__``.
GGUF semantics are the reference: where llama.cpp hard-codes a per-architecture choice
(NeoX RoPE, top-k renormalisation) the ``ARCH_TRAITS`` table says so, and a HF config is
translated into the same fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moeswap.errors import MoeswapError
from moeswap.formats.rope_scaling import Yarn, yarn_from_gguf, yarn_from_hf, yarn_mscale


@dataclass(frozen=True)
class ArchTraits:
    rope_neox: bool  # rotate (x[i], x[i + d/2]) pairs; otherwise adjacent pairs, as llama.cpp's NORM
    expert_weights_norm: bool  # llama.cpp's default renormalisation of the top-k weights
    swa_pattern: int = 0  # default sliding-window pattern: every n-th layer is global (0: none)
    expert_act: str = "silu"  # routed experts' gated activation: silu | gelu | swiglu_oai (GPT-OSS)
    gating: str = "softmax"  # softmax over all experts, or softmax_topk: top-k logits, then softmax


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
    "GptOssForCausalLM": "gpt-oss",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
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
    rope_neox: bool = field(init=False)
    expert_act: str = field(init=False)
    gating: str = field(init=False)

    def __post_init__(self) -> None:
        traits = ARCH_TRAITS.get(self.arch)
        if traits is None:
            raise MoeswapError(f"architecture '{self.arch}' is not supported "
                               f"(supported: {', '.join(ARCH_TRAITS)})")
        self.rope_neox = traits.rope_neox
        self.expert_act, self.gating = traits.expert_act, traits.gating
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
        sliding ones hold only their window (moeswap.experts.options.kv_cache_bytes)."""
        if self.kv_lora_rank:  # MLA: every layer caches the latent, none slides
            return self.kv_floats_per_token, 0
        swa = sum(2 * self.n_head_kv_swa * self.head_dim_swa for s in self.swa_layers if s)
        return self.kv_floats_per_token - swa, swa

    @property
    def moe_layers(self) -> list[int]:
        """Layers whose FFN is the MoE block (DeepSeek's leading layers stay dense)."""
        return list(range(self.n_layer_dense_lead, self.n_layer)) if self.is_moe else []


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
    kv_heads = key("attention.head_count_kv", n_head)
    n_head_kv_swa = 0
    if arch == "gemma4":
        _check_gemma4_gguf(gguf_file.path, key)
        if isinstance(kv_heads, list):  # one value per layer: sliding layers may differ from global
            n_head_kv_swa = _uniform(gguf_file.path, f"{arch}.attention.head_count_kv (sliding)",
                                     [n for n, s in zip(kv_heads, swa_layers) if s])
            kv_heads = [n for n, s in zip(kv_heads, swa_layers) if not s]
    n_head_kv = _uniform(gguf_file.path, f"{arch}.attention.head_count_kv", kv_heads)
    scaling_type = key("rope.scaling.type", "linear")
    rope_factor = float(key("rope.scaling.factor", 0.0) or 0.0)
    if scaling_type not in ("none", "linear", "yarn") and rope_factor not in (0.0, 1.0):
        raise MoeswapError(f"{gguf_file.path}: RoPE scaling '{scaling_type}' is not supported "
                           "(supported: none, linear, yarn)")
    yarn = yarn_from_gguf(gguf_file.path, key, arch) if scaling_type == "yarn" else None
    n_embd = int(required("embedding_length"))
    head_dim = int(key("attention.key_length", 0))
    embedding_scale = float(key("embedding_scale", 0.0) or 1.0)
    attention_scale = float(key("attention.scale", 0.0))
    if arch == "deepseek2":
        _check_deepseek2_gguf(gguf_file.path, key)
        # MLA runs as MQA over the latent: key_length is the cached width, the scale uses
        # the decompressed per-head key size, times YaRN's mscale(mscale_all_dim) squared.
        log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1  # the converter's 0.1x
        mscale = yarn_mscale(yarn.factor, log_mul) if yarn else 1.0
        attention_scale = mscale * mscale / math.sqrt(int(required("attention.key_length_mla")))
    if arch == "gemma4":
        embedding_scale, attention_scale = math.sqrt(n_embd), 1.0  # hard-coded in llama.cpp
    if arch == "gemma3":
        # Hard-coded in llama.cpp's gemma3 graph: embeddings times sqrt(n_embd), and the
        # 27B model (62 layers) scales queries by n_embd / n_head instead of the head size.
        embedding_scale = math.sqrt(n_embd)
        if n_layer == 62:
            attention_scale = 1.0 / math.sqrt(n_embd // n_head)
    return ModelConfig(
        arch=arch,
        n_vocab=int(embd.shape[1]),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ctx_train=int(key("context_length", 0)),
        rms_eps=float(required("attention.layer_norm_rms_epsilon")),
        n_ff=_uniform(gguf_file.path, f"{arch}.feed_forward_length", key("feed_forward_length", 0)),
        head_dim=head_dim,
        n_rot=int(key("rope.dimension_count", 0)),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_scale=rope_factor if scaling_type == "linear" and rope_factor else 1.0,
        yarn=yarn,
        rope_base_swa=float(key("rope.freq_base_swa", 10000.0)),
        n_expert=int(key("expert_count", 0)),
        n_expert_used=int(key("expert_used_count", 0)),
        n_ff_exp=_uniform(gguf_file.path, f"{arch}.expert_feed_forward_length",
                          key("expert_feed_forward_length", 0)),
        n_ff_shexp=int(key("expert_shared_feed_forward_length", 0)),
        expert_weights_norm=key("expert_weights_norm"),
        expert_weights_scale=float(key("expert_weights_scale", 0.0) or 1.0),
        sliding_window=int(key("attention.sliding_window", 0)),
        swa_layers=swa_layers,
        attention_scale=attention_scale,
        embedding_scale=embedding_scale,
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
        n_head_kv_swa=n_head_kv_swa,
        n_rot_swa=int(key("rope.dimension_count_swa", 0)),
    )


def _check_gemma4_gguf(path: Any, key: Callable[..., Any]) -> None:
    """The Gemma 4 variants moeswap computes: no per-layer embeddings, no shared KV layers."""
    if key("embedding_length_per_layer_input", 0) or key("attention.shared_kv_layers", 0):
        raise MoeswapError(f"{path}: Gemma 4 with per-layer embeddings or shared KV layers "
                           "(E2B / E4B) is not supported; the 26B MoE and 31B layouts are")


def _check_deepseek2_gguf(path: Any, key: Callable[..., Any]) -> None:
    """The DeepSeek-V2 variants moeswap computes: softmax gating, no expert groups."""
    gating = key("expert_gating_func", 1)
    if gating not in (0, 1):  # 0: unset, llama.cpp's default for V2 is softmax
        raise MoeswapError(f"{path}: expert_gating_func={gating} is not supported for deepseek2 "
                           "(supported: 1, softmax, as in DeepSeek-V2 / V2-Lite)")
    if int(key("expert_group_count", 0)) > 1:
        raise MoeswapError(f"{path}: grouped expert selection (expert_group_count > 1) "
                           "is not supported")
    if not key("attention.key_length_mla"):
        raise MoeswapError(f"{path}: key 'deepseek2.attention.key_length_mla' is missing; "
                           "files with the old fused attn_kv_b tensor are not supported, "
                           "reconvert with a current convert_hf_to_gguf.py")


def _uniform(path: Any, name: str, value: Any) -> int:
    """A per-layer array key is accepted when all layers agree; moeswap has one width per model."""
    if isinstance(value, list):
        if len(set(value)) > 1:
            raise MoeswapError(f"{path}: '{name}' differs between layers ({value}); "
                               "per-layer widths are not supported")
        value = value[0]
    return int(value)


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MoeswapError(f"{folder}: no config.json; expected a Hugging Face model folder") from None
    except json.JSONDecodeError as e:
        raise MoeswapError(f"{path}: invalid JSON ({e})") from None
    # Multimodal wrappers (Gemma3ForConditionalGeneration) keep the LM in text_config.
    return {**raw, **raw.get("text_config", {}), "architectures": raw.get("architectures", [])}


def hf_arch(hf: dict[str, Any], folder: Path) -> str:
    names = hf.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    raise MoeswapError(f"{folder}/config.json: architectures {names} not supported "
                       f"(supported: {', '.join(HF_ARCHITECTURES)})")


def hf_rope_parameters(hf: dict[str, Any], kind: str) -> dict[str, Any]:
    """RoPE parameters for 'full_attention' or 'sliding_attention' (transformers 4 and 5 layouts)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and kind in params:
        return params[kind]
    if isinstance(params, dict) and "rope_theta" in params:
        return params
    legacy = dict(hf.get("rope_scaling") or {})
    legacy.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "type" in legacy:  # transformers 4 named it "type" (DeepSeek-V2-Lite's config.json)
        legacy.setdefault("rope_type", legacy["type"])
    if kind == "sliding_attention" and "rope_local_base_freq" in hf:
        legacy = {"rope_theta": hf["rope_local_base_freq"]}
    return legacy


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
    n_layer = hf["num_hidden_layers"]
    full = hf_rope_parameters(hf, "full_attention")
    window = hf.get("sliding_window") or 0
    layer_types = hf.get("layer_types")
    swa_layers: tuple[bool, ...] = ()
    if arch not in ("gemma3", "gpt-oss", "gemma4"):
        window = window if hf.get("use_sliding_window") else 0
    elif layer_types:
        swa_layers = tuple(t == "sliding_attention" for t in layer_types)
    n_expert = (hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
                or 0)
    n_dense_lead = (hf.get("first_k_dense_replace") or 0) if arch == "deepseek2" else 0
    if arch == "qwen2moe" and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
        raise MoeswapError(f"{folder}/config.json: Qwen2-MoE with dense layers "
                           "(mlp_only_layers / decoder_sparse_step) is not supported")
    n_ff_exp = hf.get("moe_intermediate_size") or (hf["intermediate_size"] if n_expert else 0)
    if arch == "granitemoe" and hf.get("head_dim"):
        raise MoeswapError(f"{folder}/config.json: Granite with head_dim is not supported "
                           "(llama.cpp ignores it too)")
    attention_scale = 0.0
    mla: dict[str, Any] = {}
    gemma4: dict[str, Any] = {}
    if arch == "gemma4":
        gemma4 = _gemma4_config(hf, folder, full, swa_layers)
        n_expert = hf["num_experts"] if hf.get("enable_moe_block") else 0
        n_ff_exp = hf["moe_intermediate_size"] if n_expert else 0
        attention_scale = 1.0
    if arch == "deepseek2":
        _check_deepseek2_hf(hf, folder)
        mla = _mla_config(hf)
        # YaRN's mscale(mscale_all_dim) squared joins the softmax scale (yarn_apply_mscale).
        mscale_all = full.get("mscale_all_dim", 0) if full.get("rope_type") == "yarn" else 0
        mscale = yarn_mscale(full.get("factor", 1.0), mscale_all) if mscale_all else 1.0
        attention_scale = mscale * mscale * mla["head_dim_k_mla"] ** -0.5
    if arch == "granitemoe":
        attention_scale = hf.get("attention_multiplier") or 0.0
    elif arch == "gemma3":
        attention_scale = hf.get("query_pre_attn_scalar", hf.get("head_dim", 256)) ** -0.5
    fields = dict(
        arch=arch,
        n_vocab=hf["vocab_size"],
        n_embd=hf["hidden_size"],
        n_layer=n_layer,
        n_head=hf["num_attention_heads"],
        n_head_kv=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        n_ctx_train=hf.get("max_position_embeddings", 0),
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        n_ff=0 if n_expert and not n_dense_lead and arch != "gemma4" else hf["intermediate_size"],
        head_dim=(hf.get("head_dim") or 0) if arch != "granitemoe" else 0,
        rope_base=float(full.get("rope_theta", 10000.0)),
        rope_scale=_rope_factor(full, folder),
        yarn=yarn_from_hf(full, hf) if full.get("rope_type") == "yarn" else None,
        rope_base_swa=float(hf_rope_parameters(hf, "sliding_attention").get("rope_theta", 10000.0)),
        n_expert=n_expert,
        n_expert_used=(hf.get("num_experts_per_tok") or hf.get("top_k_experts") or 0) if n_expert else 0,
        n_ff_exp=n_ff_exp,
        n_ff_shexp=hf.get("shared_expert_intermediate_size") or hf.get("shared_intermediate_size") or 0,
        expert_weights_norm=(hf.get("norm_topk_prob")
                             if arch in ("qwen2moe", "qwen3moe", "olmoe", "deepseek2") else None),
        expert_weights_scale=hf.get("routed_scaling_factor") or 1.0,
        n_expert_shared=hf.get("n_shared_experts") or 0,
        n_layer_dense_lead=n_dense_lead,
        sliding_window=window,
        swa_layers=swa_layers,
        attention_scale=attention_scale,
        embedding_scale=(hf.get("embedding_multiplier") or 1.0) if arch == "granitemoe"
        else (hf["hidden_size"] ** 0.5 if arch in ("gemma3", "gemma4") else 1.0),
        residual_scale=hf.get("residual_multiplier") or 1.0,
        logit_scale=hf.get("logits_scaling") or 1.0,
        final_logit_softcap=hf.get("final_logit_softcapping") or 0.0,
        attn_logit_softcap=hf.get("attn_logit_softcapping") or 0.0,
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    return ModelConfig(**{**fields, **mla, **gemma4})


def _gemma4_config(hf: dict[str, Any], folder: Path, full_rope: dict[str, Any],
                   swa_layers: tuple[bool, ...]) -> dict[str, Any]:
    """Gemma 4's per-layer-type sizes: global layers may have larger heads and fewer kv heads."""
    if hf.get("hidden_size_per_layer_input") or hf.get("num_kv_shared_layers"):
        raise MoeswapError(f"{folder}/config.json: Gemma 4 with per-layer embeddings or shared "
                           "KV layers (E2B / E4B) is not supported; the 26B MoE and 31B layouts are")
    # "vision" makes only image tokens attend both ways: text alone stays causal.
    if hf.get("use_double_wide_mlp") or hf.get("use_bidirectional_attention") == "all":
        raise MoeswapError(f"{folder}/config.json: Gemma 4 with use_double_wide_mlp or "
                           "use_bidirectional_attention 'all' is not supported")
    per_layer = hf.get("per_layer_config") or {}
    full = next((per_layer.get(str(i), {}) for i, s in enumerate(swa_layers) if not s), {})
    head_dim_full = hf.get("global_head_dim") or full.get("head_dim") or hf["head_dim"]
    if full_rope.get("rope_type", "default") not in ("default", "proportional"):
        raise MoeswapError(f"{folder}/config.json: Gemma 4 global RoPE "
                           f"'{full_rope['rope_type']}' is not supported (supported: proportional)")
    return dict(head_dim=head_dim_full, n_rot=head_dim_full, head_dim_swa=hf["head_dim"],
                n_head_kv=full.get("num_key_value_heads") or hf["num_key_value_heads"],
                n_head_kv_swa=hf["num_key_value_heads"],
                rope_partial=float(full_rope.get("partial_rotary_factor", 1.0)))


def _check_deepseek2_hf(hf: dict[str, Any], folder: Path) -> None:
    if hf.get("topk_method", "greedy") != "greedy" and (hf.get("n_group") or 1) > 1:
        raise MoeswapError(f"{folder}/config.json: topk_method '{hf['topk_method']}' with "
                           f"n_group={hf['n_group']} is not supported (supported: greedy, as in "
                           "DeepSeek-V2-Lite); llama.cpp's converter drops the groups, changing the routing")
    if not hf.get("n_routed_experts"):
        raise MoeswapError(f"{folder}/config.json: DeepSeek-V2 without routed experts "
                           "is not supported")


def _mla_config(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek MLA sizes: the cache holds one latent (kv_lora_rank + rope dims) per token."""
    return dict(head_dim=hf["kv_lora_rank"] + hf["qk_rope_head_dim"], n_head_kv=1,
                n_rot=hf["qk_rope_head_dim"],
                q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                head_dim_k_mla=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
                head_dim_v_mla=hf["v_head_dim"])
