"""ggml's stored weight formats dequantized by torch tensor ops, on whatever device the bytes are.

``dequantize`` gives float32 values equal bit for bit to gguf-py's numpy ``gguf.quants.dequantize``
(llama.cpp's own Python package; moeswap/quant/reference.py): each block decoder below makes the
same float32 products and differences in the same order as gguf-py's, and eager torch rounds
every op's result (no fused multiply-add), as numpy does. Integer fields are unpacked as uint8
and only turned into floats where they are small integers, so the conversions are exact.
Divisions, where a format has them, would have to divide by a tensor: on CUDA, ``tensor /
python_float`` multiplies by the reciprocal, one bit off; none of these decoders divides.

Types: F32, F16, Q8_0, Q4_0, Q5_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K here, and the IQ1-IQ3
grids in moeswap/experts/device_iq.py (``DEQUANTIZERS`` holds them all).

Legend: N blocks of a matrix (row-major, each row a whole number of blocks), G groups of one
block's bytes that unpack alike, F fields packed in one byte, V values per group, S sub-blocks of
a block (each with its own scale), L values per sub-block.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from moeswap.experts.device_iq import IQ_DEQUANTIZERS
from moeswap.models.quant_experts import VECTOR_DTYPES


def dequantize(raw: torch.Tensor, ggml_type: int, rows: int, cols: int) -> torch.Tensor:
    """Stored bytes (uint8, any device) of a [rows, cols] matrix -> float32 [rows, cols]."""
    if ggml_type in VECTOR_DTYPES:
        return raw.view(VECTOR_DTYPES[ggml_type]).float().view(rows, cols)
    block_bytes = GGML_QUANT_SIZES[Q(ggml_type)][1]
    blocks = raw.view(-1, block_bytes)  # [N, block bytes]
    return DEQUANTIZERS[ggml_type](blocks).view(rows, cols)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block -> float32 [N, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _unpack(packed: torch.Tensor, width: int) -> torch.Tensor:
    """packed uint8 [..., G, V] -> [..., G, F, V]: the F = 8 / width fields of ``width`` bits
    of every byte, lowest first. (Shifts made by arange on the device: a table copied from the
    host would make a CUDA compute stream wait.)"""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)  # [F]
    return (packed.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << width) - 1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 34] -> [N, 32]: fp16 d, 32 int8."""
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


def _low_nibbles_first(qs: torch.Tensor) -> torch.Tensor:
    """qs [N, 16] -> [N, 32] uint8: the 16 low nibbles, then the 16 high ones."""
    return _unpack(qs.view(-1, 1, 16), 4).reshape(-1, 32)  # [N, 1, 2, 16] -> [N, 32]


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 18] -> [N, 32]: fp16 d, 16 bytes of nibbles offset by 8."""
    return _half(blocks, 0) * (_low_nibbles_first(blocks[:, 2:]).float() - 8)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 22] -> [N, 32]: fp16 d, 32 fifth bits (little-endian uint32), 16 bytes of nibbles."""
    high = _unpack(blocks[:, 2:6].view(-1, 4, 1), 1).reshape(-1, 32)  # [N, 4, 8, 1]
    q = _low_nibbles_first(blocks[:, 6:]) | (high << 4)  # [N, 32] in 0..31
    return _half(blocks, 0) * (q.float() - 16)


def _e2m1_doubled(device: torch.device) -> torch.Tensor:
    """The 16 e2m1 values, doubled (gguf-py's ``kvalues``: 0, 1, 2, 3, 4, 6, 8, 12, then their
    negatives), float32 [16], computed on the device: sign bit, 2 exponent bits, 1 mantissa bit."""
    n = torch.arange(16, device=device)  # [16]
    exponent, mantissa = (n >> 1) & 3, n & 1
    magnitude = torch.where(exponent == 0, mantissa, (2 + mantissa) << (exponent - 1).clamp(min=0))
    return torch.where(n >= 8, -magnitude, magnitude).float()


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 17] -> [N, 32]: e8m0 exponent, 16 bytes of e2m1 nibbles (values doubled, scale
    halved, as gguf-py and ggml do)."""
    e = blocks[:, :1].to(torch.int32)  # [N, 1]
    # ggml_e8m0_to_fp32_half: 2^(e-128) as float32 bits (subnormal for e < 2)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    values = _e2m1_doubled(blocks.device)[_low_nibbles_first(blocks[:, 1:]).long()]  # [N, 32]
    return bits.view(torch.float32) * values


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 84] -> [N, 256]: 16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit quants,
    fp16 d, fp16 dmin. 16 sub-blocks of 16."""
    scales = blocks[:, :16]  # [N, S=16]
    dl = (_half(blocks, 80) * (scales & 0xF).float()).view(-1, 16, 1)  # [N, S, 1]
    ml = (_half(blocks, 82) * (scales >> 4).float()).view(-1, 16, 1)  # [N, S, 1]
    q = _unpack(blocks[:, 16:80].view(-1, 2, 32), 2)  # [N, 2, 4, 32]
    return (dl * q.view(-1, 16, 16).float() - ml).view(-1, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 110] -> [N, 256]: 32 bytes of high bits (set: no offset), 64 bytes of 2-bit quants,
    12 bytes of 6-bit scales offset by 32, fp16 d. 16 sub-blocks of 16."""
    low = _unpack(blocks[:, 96:104].view(-1, 1, 8), 4).view(-1, 16)  # [N, S]
    high = _unpack(blocks[:, 104:108].view(-1, 1, 4), 2).view(-1, 16)  # [N, S]
    scales = (low | (high << 4)).float() - 32  # [N, S]
    dl = (_half(blocks, 108) * scales).view(-1, 16, 1)  # [N, S, 1]
    q = _unpack(blocks[:, 32:96].view(-1, 2, 32), 2).view(-1, 16, 16)  # [N, S, L]
    offset = _unpack(blocks[:, :32].view(-1, 1, 32), 1).view(-1, 16, 16) ^ 1  # [N, S, L]
    return (dl * (q.float() - (offset << 2).float())).view(-1, 256)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [N, 12] -> 6-bit scales and mins, uint8 [N, 8] each."""
    d, m, m_d = packed.view(-1, 3, 4).unbind(1)  # [N, 4] each
    scales = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)  # [N, S=8]
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)  # [N, S]
    return scales, mins


def _k_scaled(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: (d * scale) * q - dmin * min, per sub-block; q [N, S=8, L=32]."""
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d = (_half(blocks, 0) * scales.float()).view(-1, 8, 1)  # [N, S, 1]
    dm = (_half(blocks, 2) * mins.float()).view(-1, 8, 1)  # [N, S, 1]
    return (d * q.float() - dm).view(-1, 256)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 144] -> [N, 256]: fp16 d, fp16 dmin, 12 bytes of scales and mins, 128 bytes of
    nibbles (32 bytes: low nibbles one sub-block, high nibbles the next). 8 sub-blocks of 32."""
    q = _unpack(blocks[:, 16:].view(-1, 4, 32), 4)  # [N, 4, 2, 32]
    return _k_scaled(blocks, q.view(-1, 8, 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 176] -> [N, 256]: Q4_K's fields with 32 bytes of fifth bits (bit s of byte l: value
    l of sub-block s) before the nibbles."""
    low = _unpack(blocks[:, 48:].view(-1, 4, 32), 4).view(-1, 8, 32)  # [N, S, L]
    high = _unpack(blocks[:, 16:48].view(-1, 1, 32), 1).view(-1, 8, 32)  # [N, S, L]
    return _k_scaled(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 210] -> [N, 256]: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales,
    fp16 d; quants offset by 32. 16 sub-blocks of 16."""
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [N, 16]
    d = (_half(blocks, 208) * scales).view(-1, 16, 1)  # [N, 16, 1]
    low = _unpack(blocks[:, :128].view(-1, 2, 64), 4).view(-1, 8, 32)  # [N, 8, 32]
    high = _unpack(blocks[:, 128:192].view(-1, 2, 32), 2).view(-1, 8, 32)  # [N, 8, 32]
    q = (low | (high << 4)).view(-1, 16, 16).float() - 32  # [N, 16, 16]
    return (d * q).view(-1, 256)


DEQUANTIZERS = {int(Q.Q8_0): _q8_0, int(Q.Q4_0): _q4_0, int(Q.Q5_0): _q5_0,
                int(Q.MXFP4): _mxfp4, int(Q.Q2_K): _q2_k, int(Q.Q3_K): _q3_k,
                int(Q.Q4_K): _q4_k, int(Q.Q5_K): _q5_k, int(Q.Q6_K): _q6_k, **IQ_DEQUANTIZERS}
