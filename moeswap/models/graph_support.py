"""Which layers run as ggml graphs (moeswap.models.ggml_attention) and which keep the torch path.

What ggml is not asked to do keeps the torch code, which is also the graphs' reference: YaRN
RoPE and its multiplier, Phi-3.5's long/short factors picked by context, attention sinks
(GPT-OSS), soft-capping without a scaled q, attention of another class (Llama 4), and
routers other than a plain softmax. MLA and Gemma 4 attention have graphs of their own
(moeswap.models.mla_graph, gemma4_graph), which read f32 and f16 caches. ``--kv-type q8_0`` is
read by the ``LayerGraph`` alone.
"""

from __future__ import annotations

from moeswap.errors import MoeswapError
from moeswap.models.blocks import Attention, Rope
from moeswap.models.linear import QuantLinear, TorchLinear
from moeswap.models.moe import Router


def supports(attention: Attention) -> bool:
    """Whether ``attention`` can run in a ``LayerGraph`` (else it keeps its torch code)."""
    return _torch_path_reason(attention) is None


def refuse_q8_0_cache(path, arch: str, layers: list) -> None:
    """--kv-type q8_0 is read by the layer graphs' flash attention alone: refuse a model one
    of whose layers keeps the torch attention, or whose heads are not whole Q8_0 blocks."""
    for i, layer in enumerate(layers):
        attention = getattr(layer, "attention", None)
        if getattr(layer, "graph", None) is None or type(attention) is not Attention:
            how = ("keeps the torch path" if getattr(layer, "graph", None) is None
                   else "runs as a graph that reads f32 and f16 caches only")
            raise MoeswapError(
                f"{path}: --kv-type q8_0 is read only by ggml's attention graphs, and {arch}'s "
                f"attention {how} (layer {i}: "
                f"{_torch_path_reason(attention) or f'a {type(layer).__name__}'}); "
                f"use --kv-type f16")
        if attention.spec.head_dim % 32:
            raise MoeswapError(
                f"{path}: --kv-type q8_0 stores each head's keys and values in blocks of 32 "
                f"numbers, and {arch}'s heads have {attention.spec.head_dim}; "
                f"use --kv-type f16")


def _torch_path_reason(attention) -> str | None:
    """Why ``attention`` keeps its torch code, in a few words; None where a graph can run it."""
    if type(attention) is not Attention:
        return f"its attention is {type(attention).__name__}"
    w, s, rope = attention.w, attention.spec, attention.rope
    reasons = [(w.sinks is not None, "attention sinks"), (s.chunked, "chunked attention"),
               (s.softcap and not s.scale_q, "soft-capping without a scaled q"),
               (type(rope) is not Rope, f"{type(rope).__name__} RoPE"),
               (type(rope) is Rope and rope.yarn is not None, "YaRN RoPE"),
               (type(rope) is Rope and rope.mscale != 1.0, "a RoPE multiplier"),
               (not all(isinstance(p, (QuantLinear, TorchLinear))
                        for p in (w.wq, w.wk, w.wv, w.wo)), "projections of another kind")]
    return next((why for applies, why in reasons if applies), None)


def graph_routes(router: Router) -> bool:
    """Whether the graph routes as ``router`` does: llama.cpp's softmax, top-k, optional
    renormalisation and scale (the other gatings keep the torch router)."""
    return (router.gating == "softmax" and router.selection_bias is None
            and router.groups[0] <= 1)
