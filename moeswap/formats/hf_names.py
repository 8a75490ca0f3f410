"""Hugging Face tensor names -> llama.cpp GGUF names, in one table.

The engine sees one canonical naming and layout: llama.cpp's. The HF loader and ``moeswap
convert`` both read HF tensors through this table, so a HF folder and its converted GGUF give
the engine the same tensors. What one family does differently (its own norm names, the Q/K
permutation, Gemma 3's +1) is in its hooks (``formats.families``). Besides renaming, a rule may
say how the tensor changes on the way (the same changes llama.cpp's convert_hf_to_gguf.py makes):

  expert  the HF tensor is one routed expert; the GGUF tensor stacks them [E, out, in]
  stacked the HF tensor already stacks the experts [E, out, in]
  gate    take the first half of the rows (dim -2): JetMoE-style fused gate+up (Granite)
  up      take the second half of the rows
  even    take the even (gate) / odd (up) columns (dim -1): GPT-OSS's interleaved gate_up
  odd
  first   take the first (gate) / second (up) half of the columns (dim -1): Llama 4's gate_up
  second  [E, in, 2F]
  t       transpose the last two dims (GPT-OSS stores experts [E, in, out])
  kb / vb split MLA's kv_b_proj per head into k_b [H, kv_lora, nope] and v_b [H, v, kv_lora]
  mxfp4   GPT-OSS's published experts: ``*_blocks`` [E, out, in/32, 16] plus ``*_scales``
          [E, out, in/32]; even / odd then pick rows. Repacked byte for byte into ggml's MXFP4
          (``mxfp4_to_ggml``), never decoded
  q / k   llama.cpp's Q/K row permutation, for families whose GGUF RoPE is not NeoX
  norm    add 1 to an RMSNorm weight, for Gemma 3 (its HF norm computes x * (1 + w))
  squeeze drop the size-1 dimension (Qwen2-MoE's shared-expert gate [1, n_embd])
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch

from moeswap.errors import MoeswapError
from moeswap.formats.config import ModelConfig
from moeswap.formats.families import FAMILIES

_L = r"model\.layers\.(\d+)\."
# Ops that cut one HF tensor into parts of several GGUF tensors.
_FANOUT_OPS = frozenset({"gate", "up", "even", "odd", "first", "second", "kb", "vb"})
MXFP4_SCALES_SUFFIX = "_scales"  # read together with their "_blocks" tensor


@dataclass(frozen=True)
class NameRule:
    hf: str  # regex over the HF name; group 1 is the layer, group 2 (op "expert") the expert
    gguf: str  # GGUF name, "{layer}" filled in
    ops: str = ""  # "+"-joined ops from the module docstring


# First matching rule wins; a family's own norm names come before these (``_rules``).
RULES = (
    NameRule(r"model\.embed_tokens\.weight", "token_embd.weight"),  # all
    NameRule(r"lm_head\.weight", "output.weight"),  # all (absent when tied)
    NameRule(r"model\.norm\.weight", "output_norm.weight", "norm"),  # all
    NameRule(r"lm_head\.bias", "output.bias"),  # Phi-3.5-MoE
    NameRule(r"model\.norm\.bias", "output_norm.bias"),  # Phi-3.5-MoE (LayerNorm)
    NameRule(_L + r"input_layernorm\.bias", "blk.{layer}.attn_norm.bias"),  # Phi-3.5-MoE
    NameRule(_L + r"post_attention_layernorm\.bias", "blk.{layer}.ffn_norm.bias"),  # Phi-3.5-MoE
    NameRule(_L + r"input_layernorm\.weight", "blk.{layer}.attn_norm.weight", "norm"),  # all
    NameRule(_L + r"pre_feedforward_layernorm_2\.weight", "blk.{layer}.pre_ffw_norm_2.weight"),  # Gemma 4 MoE
    NameRule(_L + r"post_feedforward_layernorm_1\.weight", "blk.{layer}.post_ffw_norm_1.weight"),  # Gemma 4 MoE
    NameRule(_L + r"post_feedforward_layernorm_2\.weight", "blk.{layer}.post_ffw_norm_2.weight"),  # Gemma 4 MoE
    NameRule(_L + r"layer_scalar", "blk.{layer}.layer_output_scale.weight"),  # Gemma 4
    NameRule(_L + r"post_attention_layernorm\.weight", "blk.{layer}.ffn_norm.weight"),  # all but Gemma, GPT-OSS
    NameRule(_L + r"self_attn\.q_proj\.weight", "blk.{layer}.attn_q.weight", "q"),  # all
    NameRule(_L + r"self_attn\.k_proj\.weight", "blk.{layer}.attn_k.weight", "k"),  # all
    NameRule(_L + r"self_attn\.v_proj\.weight", "blk.{layer}.attn_v.weight"),  # all
    NameRule(_L + r"self_attn\.o_proj\.weight", "blk.{layer}.attn_output.weight"),  # all
    NameRule(_L + r"self_attn\.q_proj\.bias", "blk.{layer}.attn_q.bias", "q"),  # Qwen2-MoE
    NameRule(_L + r"self_attn\.k_proj\.bias", "blk.{layer}.attn_k.bias", "k"),  # Qwen2-MoE
    NameRule(_L + r"self_attn\.v_proj\.bias", "blk.{layer}.attn_v.bias"),  # Qwen2-MoE
    NameRule(_L + r"self_attn\.o_proj\.bias", "blk.{layer}.attn_output.bias"),  # Granite (bias=True)
    NameRule(_L + r"self_attn\.q_norm\.weight", "blk.{layer}.attn_q_norm.weight", "norm"),  # Qwen3-MoE, OLMoE, Gemma 3
    NameRule(_L + r"self_attn\.k_norm\.weight", "blk.{layer}.attn_k_norm.weight", "norm"),  # Qwen3-MoE, OLMoE, Gemma 3
    NameRule(_L + r"self_attn\.q_a_proj\.weight", "blk.{layer}.attn_q_a.weight"),  # DeepSeek-V2 MLA
    NameRule(_L + r"self_attn\.q_a_layernorm\.weight", "blk.{layer}.attn_q_a_norm.weight"),  # DeepSeek-V2
    NameRule(_L + r"self_attn\.q_b_proj\.weight", "blk.{layer}.attn_q_b.weight"),  # DeepSeek-V2
    NameRule(_L + r"self_attn\.kv_a_proj_with_mqa\.weight", "blk.{layer}.attn_kv_a_mqa.weight"),  # DeepSeek-V2
    NameRule(_L + r"self_attn\.kv_a_layernorm\.weight", "blk.{layer}.attn_kv_a_norm.weight"),  # DeepSeek-V2
    NameRule(_L + r"self_attn\.kv_b_proj\.weight", "blk.{layer}.attn_k_b.weight", "kb"),  # DeepSeek-V2
    NameRule(_L + r"self_attn\.kv_b_proj\.weight", "blk.{layer}.attn_v_b.weight", "vb"),  # DeepSeek-V2
    NameRule(_L + r"self_attn\.sinks", "blk.{layer}.attn_sinks.weight"),  # GPT-OSS
    NameRule(_L + r"mlp\.gate_proj\.weight", "blk.{layer}.ffn_gate.weight"),  # Gemma 3, Llama (dense)
    NameRule(_L + r"mlp\.up_proj\.weight", "blk.{layer}.ffn_up.weight"),  # Gemma 3, Llama (dense)
    NameRule(_L + r"mlp\.down_proj\.weight", "blk.{layer}.ffn_down.weight"),  # Gemma 3, Llama (dense)
    NameRule(_L + r"block_sparse_moe\.gate\.weight", "blk.{layer}.ffn_gate_inp.weight"),  # Mixtral
    NameRule(_L + r"block_sparse_moe\.experts\.(\d+)\.w1\.weight", "blk.{layer}.ffn_gate_exps.weight", "expert"),  # Mixtral
    NameRule(_L + r"block_sparse_moe\.experts\.(\d+)\.w3\.weight", "blk.{layer}.ffn_up_exps.weight", "expert"),  # Mixtral
    NameRule(_L + r"block_sparse_moe\.experts\.(\d+)\.w2\.weight", "blk.{layer}.ffn_down_exps.weight", "expert"),  # Mixtral
    NameRule(_L + r"mlp\.gate\.weight", "blk.{layer}.ffn_gate_inp.weight"),  # Qwen2/3-MoE, OLMoE, DeepSeek
    NameRule(_L + r"mlp\.gate\.e_score_correction_bias", "blk.{layer}.exp_probs_b.bias"),  # DeepSeek-V3 selection bias
    NameRule(_L + r"mlp\.experts\.(\d+)\.gate_proj\.weight", "blk.{layer}.ffn_gate_exps.weight", "expert"),  # Qwen2/3-MoE, OLMoE
    NameRule(_L + r"mlp\.experts\.(\d+)\.up_proj\.weight", "blk.{layer}.ffn_up_exps.weight", "expert"),  # Qwen2/3-MoE, OLMoE
    NameRule(_L + r"mlp\.experts\.(\d+)\.down_proj\.weight", "blk.{layer}.ffn_down_exps.weight", "expert"),  # Qwen2/3-MoE, OLMoE
    NameRule(_L + r"mlp\.shared_expert\.gate_proj\.weight", "blk.{layer}.ffn_gate_shexp.weight"),  # Qwen2-MoE
    NameRule(_L + r"mlp\.shared_expert\.up_proj\.weight", "blk.{layer}.ffn_up_shexp.weight"),  # Qwen2-MoE
    NameRule(_L + r"mlp\.shared_expert\.down_proj\.weight", "blk.{layer}.ffn_down_shexp.weight"),  # Qwen2-MoE
    NameRule(_L + r"mlp\.shared_expert_gate\.weight", "blk.{layer}.ffn_gate_inp_shexp.weight", "squeeze"),  # Qwen2-MoE
    NameRule(_L + r"mlp\.shared_experts\.gate_proj\.weight", "blk.{layer}.ffn_gate_shexp.weight"),  # DeepSeek-V2
    NameRule(_L + r"mlp\.shared_experts\.up_proj\.weight", "blk.{layer}.ffn_up_shexp.weight"),  # DeepSeek-V2
    NameRule(_L + r"mlp\.shared_experts\.down_proj\.weight", "blk.{layer}.ffn_down_shexp.weight"),  # DeepSeek-V2
    NameRule(_L + r"mlp\.router\.weight", "blk.{layer}.ffn_gate_inp.weight"),  # GPT-OSS
    NameRule(_L + r"mlp\.router\.bias", "blk.{layer}.ffn_gate_inp.bias"),  # GPT-OSS
    NameRule(_L + r"mlp\.experts\.gate_up_proj", "blk.{layer}.ffn_gate_exps.weight", "stacked+even+t"),  # GPT-OSS
    NameRule(_L + r"mlp\.experts\.gate_up_proj", "blk.{layer}.ffn_up_exps.weight", "stacked+odd+t"),  # GPT-OSS
    NameRule(_L + r"mlp\.experts\.gate_up_proj_bias", "blk.{layer}.ffn_gate_exps.bias", "stacked+even"),  # GPT-OSS
    NameRule(_L + r"mlp\.experts\.gate_up_proj_bias", "blk.{layer}.ffn_up_exps.bias", "stacked+odd"),  # GPT-OSS
    NameRule(_L + r"mlp\.experts\.down_proj", "blk.{layer}.ffn_down_exps.weight", "stacked+t"),  # GPT-OSS
    NameRule(_L + r"mlp\.experts\.gate_up_proj_blocks", "blk.{layer}.ffn_gate_exps.weight", "stacked+mxfp4+even"),  # GPT-OSS (published, MXFP4)
    NameRule(_L + r"mlp\.experts\.gate_up_proj_blocks", "blk.{layer}.ffn_up_exps.weight", "stacked+mxfp4+odd"),  # GPT-OSS (published, MXFP4)
    NameRule(_L + r"mlp\.experts\.down_proj_blocks", "blk.{layer}.ffn_down_exps.weight", "stacked+mxfp4"),  # GPT-OSS (published, MXFP4)
    NameRule(_L + r"mlp\.experts\.down_proj_bias", "blk.{layer}.ffn_down_exps.bias", "stacked"),  # GPT-OSS
    NameRule(_L + r"router\.proj\.weight", "blk.{layer}.ffn_gate_inp.weight"),  # Gemma 4
    NameRule(_L + r"router\.scale", "blk.{layer}.ffn_gate_inp.scale"),  # Gemma 4
    NameRule(_L + r"router\.per_expert_scale", "blk.{layer}.ffn_down_exps.scale"),  # Gemma 4
    NameRule(_L + r"experts\.gate_up_proj", "blk.{layer}.ffn_gate_up_exps.weight", "stacked"),  # Gemma 4 (fused, gate rows first)
    NameRule(_L + r"experts\.down_proj", "blk.{layer}.ffn_down_exps.weight", "stacked"),  # Gemma 4
    NameRule(_L + r"block_sparse_moe\.router\.layer\.weight", "blk.{layer}.ffn_gate_inp.weight"),  # Granite-MoE
    NameRule(_L + r"block_sparse_moe\.input_linear\.weight", "blk.{layer}.ffn_gate_exps.weight", "stacked+gate"),  # Granite-MoE
    NameRule(_L + r"block_sparse_moe\.input_linear\.weight", "blk.{layer}.ffn_up_exps.weight", "stacked+up"),  # Granite-MoE
    NameRule(_L + r"block_sparse_moe\.output_linear\.weight", "blk.{layer}.ffn_down_exps.weight", "stacked"),  # Granite-MoE
    NameRule(_L + r"shared_mlp\.input_linear\.weight", "blk.{layer}.ffn_gate_shexp.weight", "gate"),  # Granite-MoE-Shared
    NameRule(_L + r"shared_mlp\.input_linear\.weight", "blk.{layer}.ffn_up_shexp.weight", "up"),  # Granite-MoE-Shared
    NameRule(_L + r"shared_mlp\.output_linear\.weight", "blk.{layer}.ffn_down_shexp.weight"),  # Granite-MoE-Shared
    NameRule(_L + r"feed_forward\.gate_proj\.weight", "blk.{layer}.ffn_gate.weight"),  # Llama 4 (dense)
    NameRule(_L + r"feed_forward\.up_proj\.weight", "blk.{layer}.ffn_up.weight"),  # Llama 4 (dense)
    NameRule(_L + r"feed_forward\.down_proj\.weight", "blk.{layer}.ffn_down.weight"),  # Llama 4 (dense)
    NameRule(_L + r"feed_forward\.router\.weight", "blk.{layer}.ffn_gate_inp.weight"),  # Llama 4
    NameRule(_L + r"feed_forward\.experts\.gate_up_proj", "blk.{layer}.ffn_gate_exps.weight", "stacked+first+t"),  # Llama 4
    NameRule(_L + r"feed_forward\.experts\.gate_up_proj", "blk.{layer}.ffn_up_exps.weight", "stacked+second+t"),  # Llama 4
    NameRule(_L + r"feed_forward\.experts\.down_proj", "blk.{layer}.ffn_down_exps.weight", "stacked+t"),  # Llama 4
    NameRule(_L + r"feed_forward\.shared_expert\.gate_proj\.weight", "blk.{layer}.ffn_gate_shexp.weight"),  # Llama 4
    NameRule(_L + r"feed_forward\.shared_expert\.up_proj\.weight", "blk.{layer}.ffn_up_shexp.weight"),  # Llama 4
    NameRule(_L + r"feed_forward\.shared_expert\.down_proj\.weight", "blk.{layer}.ffn_down_shexp.weight"),  # Llama 4
)

_COMPILED = tuple((re.compile(rule.hf), rule) for rule in RULES)
_LAYER = re.compile(_L)

# HF tensors llama.cpp's converter drops (recomputed at load time), and MXFP4 scales (read with
# their blocks).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|.*\.experts\.\w+_proj" + MXFP4_SCALES_SUFFIX + "$")

# Multimodal wrappers (Gemma 3 / 4 ...ForConditionalGeneration): the language model's tensors
# under a prefix, matched as the text-only model's; the vision / audio towers are not converted.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_OTHER_MODALITIES = re.compile(r"(model\.)?(vision_tower|vision_model|multi_modal_projector|"
                               r"embed_vision|audio_tower|embed_audio)\.")


@dataclass(frozen=True)
class Part:
    """Where (part of) one GGUF tensor comes from."""

    hf_name: str
    ops: frozenset[str]
    expert: int | None = None  # op "expert": this HF tensor is expert `expert` of the stack


def plan(hf_names: Iterable[str], arch: str, n_layer: int | None = None) -> dict[str, list[Part]]:
    """GGUF name -> its parts (per-expert parts sorted by expert). Unknown names are an error.
    Layers from ``n_layer`` on are multi-token-prediction layers (DeepSeek-V3's layer 61):
    skipped, as llama.cpp's converter skips them."""
    result: dict[str, list[Part]] = {}
    unknown = []
    rules = _rules(arch)
    for hf_name in hf_names:
        if _IGNORED.match(hf_name) or _OTHER_MODALITIES.match(hf_name):
            continue
        text_name = _text_model_name(hf_name)
        layer = _LAYER.match(text_name)
        if n_layer is not None and layer and int(layer.group(1)) >= n_layer:
            continue
        matched = False
        for pattern, rule in rules:
            m = pattern.fullmatch(text_name)
            if m is None:
                continue
            ops = frozenset(op for op in rule.ops.split("+") if op)
            gguf_name = rule.gguf.format(layer=m.group(1)) if m.groups() else rule.gguf
            expert = int(m.group(2)) if "expert" in ops else None
            result.setdefault(gguf_name, []).append(Part(hf_name, ops, expert))
            matched = True
            if not (_FANOUT_OPS & ops):
                break  # a fused gate+up (or kv_b) tensor feeds two GGUF tensors; others feed one
        if not matched:
            unknown.append(hf_name)
    if unknown:
        raise MoeswapError(f"{len(unknown)} tensor(s) have no GGUF name for architecture "
                           f"'{arch}', e.g. '{unknown[0]}'; this model layout is not supported")
    for parts in result.values():
        parts.sort(key=lambda p: -1 if p.expert is None else p.expert)
    return result


def _rules(arch: str) -> tuple[tuple[re.Pattern[str], NameRule], ...]:
    """The family's own norm names first: the general lines would name those norms otherwise."""
    own = tuple(NameRule(_L + re.escape(hf) + r"\.weight", f"blk.{{layer}}.{gguf}.weight", "norm")
                for hf, gguf in FAMILIES[arch].hf_layer_norms.items())
    return tuple((re.compile(rule.hf), rule) for rule in own) + _COMPILED


def _text_model_name(hf_name: str) -> str:
    for prefix, plain in _TEXT_PREFIXES:
        if hf_name.startswith(prefix):
            return plain + hf_name[len(prefix):]
    return hf_name


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K permutation: per head, interleave the two rotary halves.

    HF rotates (x[i], x[i + d/2]); GGUF llama-family RoPE rotates adjacent pairs.
    Legend: H heads, P=2 halves, R rows per half, C columns (absent for a bias).
    """
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])  # [H, P, R, C]
            .swapaxes(1, 2)  # [H, R, P, C]
            .reshape(w.shape))


def transform(w: torch.Tensor, ops: frozenset[str], config: ModelConfig) -> torch.Tensor:
    """Apply a part's element-level ops (not the expert/half selection) in llama.cpp's order."""
    family = FAMILIES[config.arch]
    if "q" in ops and family.hf_qk_permuted:
        w = llama_permute(w, config.n_head)
    if "k" in ops and family.hf_qk_permuted:
        w = llama_permute(w, config.n_head_kv)
    if "t" in ops:
        w = w.transpose(-1, -2)
    if {"kb", "vb"} & ops:
        w = split_kv_b(w, config, "kb" in ops)
    if "norm" in ops and family.hf_norm_plus_one:
        w = w + 1.0
    if "squeeze" in ops:
        w = w.reshape(-1)
    return w


def split_kv_b(w: torch.Tensor, c: ModelConfig, key: bool) -> torch.Tensor:
    """llama.cpp's split of kv_b_proj [H*(P+V), L]: k_b [H, L, P] (transposed) or v_b [H, V, L].

    Legend: H heads, P non-rotated key dims per head, V value dims per head, L kv_lora_rank.
    """
    nope = c.head_dim_k_mla - c.n_rot
    kv_b = w.reshape(c.n_head, nope + c.head_dim_v_mla, w.shape[-1])  # [H, P+V, L]
    return kv_b[:, :nope].transpose(1, 2) if key else kv_b[:, nope:]  # [H, L, P] / [H, V, L]


def mxfp4_to_ggml(blocks: torch.Tensor, scales: torch.Tensor, ops: frozenset[str]) -> torch.Tensor:
    """OpenAI's MXFP4 (blocks [..., R, B, 16]: byte k holds elements 2k (low nibble) and 2k+1;
    scales [..., R, B] e8m0) -> ggml's block_mxfp4 bytes [..., R', B*17] (scale byte, then byte j
    holding elements j (low) and j+16), rows halved by even / odd. Same bytes as llama.cpp's
    GptOssModel.repack_mxfp4. Legend: R rows, B blocks of 32 per row."""
    if "even" in ops or "odd" in ops:
        start = 0 if "even" in ops else 1
        blocks, scales = blocks[..., start::2, :, :], scales[..., start::2, :]
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., R, B, 32]
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [..., R, B, 16]
    return torch.cat((scales[..., None], packed), dim=-1).flatten(-2)  # [..., R, B*17]


def select_part(w: torch.Tensor, ops: frozenset[str]) -> torch.Tensor:
    """The gate or up part of a fused gate+up tensor: halves of dim -2 or -1, or interleaved dim -1."""
    if "gate" in ops:
        return w[..., : w.shape[-2] // 2, :]
    if "up" in ops:
        return w[..., w.shape[-2] // 2:, :]
    if "even" in ops:
        return w[..., 0::2]
    if "odd" in ops:
        return w[..., 1::2]
    if "first" in ops:
        return w[..., : w.shape[-1] // 2]
    if "second" in ops:
        return w[..., w.shape[-1] // 2:]
    return w
