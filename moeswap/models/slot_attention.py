"""One piece's attention over a KV cache's slots as ggml nodes, llama.cpp's graph: scores
``mul_mat(k, q)`` over the first S slots (whole spans of ``SLOT_SPAN``, a -inf mask for slots a
query may not see), the optional soft-cap, the masked and scaled softmax, then
``mul_mat(v, probs)`` over the transposed values; a Q8_0 cache (values as rows) through
``flash_attn_ext``, llama.cpp's flash branch.

With ``grouped`` (the fast mode: repacked layouts, not ``--exact-tiers``), one token with
grouped kv heads (H > K) takes a kv head's G = H / K query heads as its columns: each key and
value row is then read once for the G heads (llama.cpp's graph reads it once a query head), and
ggml's tiled kernel takes the products where a single column goes through ``vec_dot``. Each sum
is then a prompt piece's (a whole forward's bits), not llama.cpp's decode step's: the last bits
differ, as repacked products do. A decode step at 8,192 positions of the built-in model (8
heads, 4 kv heads, head size 32) took 6.7 -> 2.8 ms (docs/KERNELS.md).

Legend (ggml order, ne0 first): E head size, H query heads, K kv heads, G = H / K, T tokens of
the piece, S attended slots, C the slots' capacity.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

from moeswap.quant.graph_arena import Arena

_F32 = int(GGMLQuantizationType.F32)
_PREC_F32 = 10  # GGML_PREC_F32: flash attention accumulates in f32 (llama.cpp sets it)


def attend(ggml, context: int, arena: Arena, q: int, t: int, cache: tuple[int, int], slots,
           mask: int, n_slots: int, spec, grouped: bool) -> int:
    """q (E, H, T) against the first ``n_slots`` slots of ``cache`` (the keys' and values' ggml
    tensors over ``slots``), ``mask`` (S, T); ``spec`` the layer's AttentionSpec -> heads
    (E, H, T), or, ``grouped`` and one token with grouped kv heads, (E, G, K) (the same
    numbers in the same order: (E, H) of the token)."""
    cache_keys, cache_values = cache
    e, h, kv = spec.head_dim, spec.n_head, spec.n_head_kv
    row = slots.keys[0].nbytes  # of a slot's K*E keys
    keys = arena.view(ggml.ggml_view_3d(context, cache_keys, e, n_slots, kv, row, row // kv, 0))
    scale = 1.0 if spec.scale_q else spec.scale
    if slots.rows:  # llama.cpp's flash branch; it caps as scale, then cap*tanh(s/cap)
        q_rows = arena.view(ggml.ggml_permute(context, q, 0, 2, 1, 3))  # (E, T, H)
        values = arena.view(ggml.ggml_view_3d(context, cache_values, e, n_slots, kv, row,
                                              row // kv, 0))  # (E, S, K)
        heads = arena.op(ggml.ggml_flash_attn_ext(context, q_rows, keys, values, mask, scale,
                                                  0.0, spec.softcap))  # (E, H, T)
        ggml.ggml_prec_set_acc(heads, _PREC_F32)
        return heads
    grouped = grouped and t == 1 and h > kv
    if grouped:  # (E, G, K), its mask (S, G)
        q_rows = arena.view(ggml.ggml_reshape_3d(context, q, e, h // kv, kv))
        shape = ggml.ggml_new_tensor_2d(context, _F32, n_slots, h // kv)  # repeat's target only
        mask = arena.op(ggml.ggml_repeat(context, mask, shape))
    else:
        q_rows = arena.view(ggml.ggml_permute(context, q, 0, 2, 1, 3))  # (E, T, H)
    scores = arena.op(ggml.ggml_mul_mat(context, keys, q_rows))  # (S, T, H) or (S, G, K)
    if spec.softcap:  # llama.cpp's order: cap, then the softmax's scale
        scores = arena.op(ggml.ggml_scale(context, scores, 1.0 / spec.softcap))
        scores = arena.op(ggml.ggml_tanh(context, scores))
        scores = arena.op(ggml.ggml_scale(context, scores, spec.softcap))
    probs = arena.op(ggml.ggml_soft_max_ext(context, scores, mask, scale, 0.0))
    size_of, capacity = slots.keys.element_size(), slots.capacity
    values = arena.view(ggml.ggml_view_3d(context, cache_values, n_slots, e, kv,
                                          capacity * size_of, e * capacity * size_of, 0))
    heads = arena.op(ggml.ggml_mul_mat(context, values, probs))  # (E, T, H) or (E, G, K)
    if grouped:
        return heads
    return arena.op(ggml.ggml_cont(context, arena.view(
        ggml.ggml_permute(context, heads, 0, 2, 1, 3))))  # (E, H, T)
