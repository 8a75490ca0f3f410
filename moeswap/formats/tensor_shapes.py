"""Load-time shape checks, as llama.cpp's loader checks every tensor against the shape its graph
needs: a file whose tensors do not fit together is refused naming the tensor, before any token
is computed, instead of failing in the middle of a forward with a torch error.

Only what every family shares is checked: the projections that read the residual stream
(n_embd wide) or write to it, the norms on it, the query/key/value heads (except MLA's), the
router, the expert stacks (one per expert of the router) and that a down projection takes
what its gate and up give. Shapes are torch
order ([out, in]; expert stacks [X, out, in]).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

from moeswap.errors import MoeswapError
from moeswap.formats.config import ModelConfig

_BLOCK = r"blk\.\d+\."
READS_STREAM = re.compile(  # [..., n_embd]
    rf"(token_embd|output|{_BLOCK}(attn_q|attn_k|attn_v|attn_q_a|attn_kv_a_mqa|ffn_gate|ffn_up"
    r"|ffn_gate_shexp|ffn_up_shexp|ffn_gate_inp|ffn_gate_exps|ffn_up_exps|ffn_gate_up_exps))\.weight")
WRITES_STREAM = re.compile(  # [..., n_embd, in]
    rf"{_BLOCK}(attn_output|ffn_down|ffn_down_shexp|ffn_down_exps)\.weight")
STREAM_NORMS = re.compile(  # [n_embd]
    rf"(output_norm|{_BLOCK}(attn_norm|ffn_norm|post_attention_norm))\.weight")
EXPERT_STACKS = re.compile(rf"{_BLOCK}(ffn_gate_inp|ffn_\w+_exps)\.weight")  # [X, ...]


def check_shapes(where: str, config: ModelConfig, names: Iterable[str],
                 shape_of: Callable[[str], tuple[int, ...]]) -> None:
    """Raise a MoeswapError naming the first tensor whose shape cannot run in this model."""
    shapes = {name: tuple(shape_of(name)) for name in names}
    d = config.n_embd

    def refuse(name: str, expected: str) -> None:
        raise MoeswapError(f"{where}: tensor '{name}' has shape {list(shapes[name])}, {expected}")

    for name, shape in shapes.items():
        if READS_STREAM.fullmatch(name) and shape[-1] != d:
            refuse(name, f"expected its last dimension (input width) to be n_embd = {d}")
        if WRITES_STREAM.fullmatch(name) and (len(shape) < 2 or shape[-2] != d):
            refuse(name, f"expected its output width to be n_embd = {d}")
        if STREAM_NORMS.fullmatch(name) and shape != (d,):
            refuse(name, f"expected [{d}]")
        if EXPERT_STACKS.fullmatch(name) and config.n_expert and shape[0] != config.n_expert:
            refuse(name, f"expected one row or matrix per expert: expert_count = {config.n_expert}")
    for layer in range(config.n_layer):
        swa = layer < len(config.swa_layers) and config.swa_layers[layer]
        head_dim = config.head_dim_swa if swa else config.head_dim
        n_head_kv = config.n_head_kv_swa if swa else config.n_head_kv
        heads = {"q": (config.n_head, "head_count"), "k": (n_head_kv, "head_count_kv"),
                 "v": (n_head_kv, "head_count_kv")}
        for part, (n, key) in heads.items():
            name = f"blk.{layer}.attn_{part}.weight"
            if not config.kv_lora_rank and name in shapes and shapes[name][0] != n * head_dim:
                refuse(name, f"expected attention.{key} = {n} heads of {head_dim}")
        for kind in ("", "_shexp", "_exps"):
            down = f"blk.{layer}.ffn_down{kind}.weight"
            if down not in shapes:
                continue
            for first, halves in ((f"blk.{layer}.ffn_gate{kind}.weight", 1),
                                  (f"blk.{layer}.ffn_up{kind}.weight", 1),
                                  (f"blk.{layer}.ffn_gate_up{kind}.weight", 2)):
                if first in shapes and shapes[first][-2] != halves * shapes[down][-1]:
                    refuse(down, f"expected its input width to match '{first}' "
                                 f"({shapes[first][-2] // halves})")
