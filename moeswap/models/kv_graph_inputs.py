"""What a layer graph (moeswap.models.ggml_attention) takes from a KV cache's slots: their
buffers bound as ggml tensors, and per piece of new tokens the slots they go to and the mask
of what each query sees.

Legend: T new tokens of a piece, C slots, S attended slots, K kv heads, E head size.
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeswap.models.blocks import visible_keys
from moeswap.quant.kernels import check_status

_F32, _F16 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16)
# KVCache's dtype -> its ggml type (torch.uint8: blocks.KV_Q8_0, bytes of Q8_0 blocks)
_GGML_TYPES = {torch.float32: _F32, torch.float16: _F16,
               torch.uint8: int(GGMLQuantizationType.Q8_0)}


def bind_cache(ggml, context: int, slots, kv_width: int, buffers) -> tuple[int, int]:
    """ggml tensors in ``context`` over the slots' buffers: keys (K*E, C) and values
    (1, C*K*V), or values (K*E, C) too in a Q8_0 cache. ``buffers`` (slots -> its two ggml
    buffers) keeps one pair per slots, freed with them."""
    kind = _GGML_TYPES[slots.keys.dtype]
    keys = ggml.ggml_new_tensor_2d(context, kind, kv_width, slots.capacity)
    values = (ggml.ggml_new_tensor_2d(context, kind, kv_width, slots.capacity) if slots.rows
              else ggml.ggml_new_tensor_2d(context, kind, 1, slots.values.numel()))
    if slots not in buffers:
        made = buffers[slots] = [ggml.ggml_backend_cpu_buffer_from_ptr(data.data_ptr(), data.nbytes)
                                 for data in (slots.keys, slots.values)]
        weakref.finalize(slots, _free_buffers, ggml, made)
    for tensor, data, buffer in zip((keys, values), (slots.keys, slots.values), buffers[slots]):
        check_status(ggml.ggml_backend_tensor_alloc(buffer, tensor,
                                                    ctypes.c_void_p(data.data_ptr())),
                     "KV cache tensor")
    return keys, values


def _free_buffers(ggml, buffers: list) -> None:
    for buffer in buffers:
        ggml.ggml_backend_buffer_free(buffer)


def piece_inputs(slots, at, first: int, n_new: int, n_slots: int, window: int,
                  chunked: bool, kv_width: int) -> tuple[torch.Tensor, ...]:
    """Key slots [T] and value slots [T*K*E] int64, mask [T, S] float32 (0 where query t sees
    slot j, -inf elsewhere) of a piece; of a Q8_0 cache, value slots [T] (values as rows) and
    an f16 mask (flash attention's)."""
    # numpy: a decode step makes these for every slot layout, and torch's calls cost more
    key_slots = (np.arange(at.start, at.stop) if isinstance(at, slice)
                 else at.numpy().astype(np.int64))  # [T]
    # value (e, slot) sits at e * C + slot of the transposed buffer; rows in (T, K*E) order
    value_slots = key_slots if slots.rows else (np.arange(kv_width)[None, :] * slots.capacity
                                                + key_slots[:, None]).reshape(-1)  # [T*K*E]
    visible = visible_keys(np.arange(first, first + n_new), slots.positions[:n_slots].numpy(),
                           window, chunked)  # [T, S]
    visible &= (np.arange(n_slots) < slots.filled)[None, :]  # unwritten slots: none
    mask = np.where(visible, np.float32(0), np.float32(-np.inf))  # [T, S]
    if slots.rows:
        mask = mask.astype(np.float16)
    return tuple(torch.from_numpy(part) for part in (key_slots, value_slots, mask))
