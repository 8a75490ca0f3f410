"""The IQ1-IQ3 grid formats dequantized by torch tensor ops on the device, bit for bit gguf-py's.

Each block stores indices into a codebook of 4 or 8 values a point (the grids), a sign pattern
per group of 8 values, and 4-bit scales; ``gguf.quants`` holds the grids (decoded from llama.cpp's
tables by its ``init_grid``) and the ``ksigns`` table (a 7-bit index and its parity bit as the
8th sign). The decoders make the same float32 products in the same order as gguf-py's numpy
(``d * (0.5 + s) * 0.25``, then ``* grid * signs``), so eager torch gives its bits exactly.

The grids (at most 2048 x 8 float32) are copied to a device once and kept there (``_tables``):
copying them per call would make the compute stream wait for the host; for the same reason the
shift vectors are made by ``arange`` on the device.

Legend: N blocks, G groups of 8 (or 4) values sharing a grid index, P grid points, S sub-blocks.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

QK_K = 256
_GRID_CLASSES = {Q.IQ2_XXS: quants.IQ2_XXS, Q.IQ2_XS: quants.IQ2_XS, Q.IQ2_S: quants.IQ2_S,
                 Q.IQ3_XXS: quants.IQ3_XXS, Q.IQ3_S: quants.IQ3_S, Q.IQ1_S: quants.IQ1_S,
                 Q.IQ1_M: quants.IQ1_M}
_tables: dict[tuple[int, torch.device], torch.Tensor] = {}  # (type or -1: ksigns, device)


def _grid(qtype: Q, device: torch.device) -> torch.Tensor:
    """The type's grid as float32 [P, values per point] on ``device``."""
    key = (int(qtype), device)
    if key not in _tables:
        cls = _GRID_CLASSES[qtype]
        cls.init_grid()
        _tables[key] = torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy()).to(device)
    return _tables[key]


def _ksigns(device: torch.device) -> torch.Tensor:
    """llama.cpp's ksigns_iq2xs: uint8 [128], a 7-bit index with its parity as bit 7."""
    key = (-1, device)
    if key not in _tables:
        table = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8)
        _tables[key] = table.to(device)
    return _tables[key]


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block -> float32 [N, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [...] -> uint8 [..., 8]: each byte's bits, lowest first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)  # [8]
    return (packed.unsqueeze(-1) >> shifts) & 1


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """0/1 sign bits -> float32 +1/-1."""
    return 1.0 - 2.0 * bits.float()


def _u16(blocks: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Bytes [start, end) of every block as little-endian uint16 -> int32 [N, (end-start)/2]."""
    pairs = blocks[:, start:end].to(torch.int32).view(blocks.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 8)


def _u32(blocks: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Bytes [start, end) as little-endian uint32 -> int64 [N, (end-start)/4]."""
    quads = blocks[:, start:end].to(torch.int64).view(blocks.shape[0], -1, 4)
    return quads[..., 0] | quads[..., 1] << 8 | quads[..., 2] << 16 | quads[..., 3] << 24


def _ksigned(indices: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices [...] -> float32 [..., 8] of +1/-1 through the ksigns table."""
    return _signs(_bits(_ksigns(indices.device)[indices.long()]))


def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 66] -> [N, 256]: fp16 d, 8 x (4 grid bytes, uint32 of 4 x 7 sign bits | 4-bit scale)."""
    n = blocks.shape[0]
    words = _u32(blocks, 2, 66).view(n, 8, 2)  # [N, S=8, 2]
    db = (_half(blocks, 0) * (0.5 + (words[..., 1] >> 28).float()) * 0.25).view(n, 8, 1, 1)
    shifts = torch.arange(0, 28, 7, device=blocks.device)
    signs = _ksigned((words[..., 1:] >> shifts) & 0x7F)  # [N, S, G=4, 8]
    index = blocks[:, 2:66].view(n, 8, 8)[..., :4]  # [N, S, G]: the first 4 bytes of each 8
    grid = _grid(Q.IQ2_XXS, blocks.device)[index.long()]  # [N, S, G, 8]
    return (db * grid * signs).view(n, 256)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 74] -> [N, 256]: fp16 d, 32 uint16 (9-bit grid index | 7-bit sign index), 8 bytes
    of two 4-bit scales."""
    n = blocks.shape[0]
    qs = _u16(blocks, 2, 66)  # [N, 32]
    scales = torch.stack((blocks[:, 66:74] & 0x0F, blocks[:, 66:74] >> 4), -1).view(n, 16)
    db = (_half(blocks, 0) * (0.5 + scales.float()) * 0.25).view(n, 16, 1, 1)  # [N, S, 1, 1]
    signs = _ksigned(qs >> 9).view(n, 16, 2, 8)
    grid = _grid(Q.IQ2_XS, blocks.device)[(qs & 511).long()].view(n, 16, 2, 8)
    return (db * grid * signs).view(n, 256)


def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 82] -> [N, 256]: fp16 d, 32 low index bytes, 32 sign bytes, 8 bytes of 4 x 2 high
    index bits, 8 bytes of two 4-bit scales."""
    n = blocks.shape[0]
    scales = torch.stack((blocks[:, 74:82] & 0x0F, blocks[:, 74:82] >> 4), -1).view(n, 16)
    db = (_half(blocks, 0) * (0.5 + scales.float()) * 0.25).view(n, 16, 1, 1)
    signs = _signs(_bits(blocks[:, 34:66])).view(n, 16, 2, 8)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device)
    high = ((blocks[:, 66:74].unsqueeze(-1) >> shifts) & 3).view(n, 32)  # [N, 32]
    index = blocks[:, 2:34].long() | (high.long() << 8)
    grid = _grid(Q.IQ2_S, blocks.device)[index].view(n, 16, 2, 8)
    return (db * grid * signs).view(n, 256)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 98] -> [N, 256]: fp16 d, 64 grid bytes (points of 4), 8 uint32 of 4 x 7 sign bits
    | 4-bit scale."""
    n = blocks.shape[0]
    words = _u32(blocks, 66, 98)  # [N, S=8]
    db = (_half(blocks, 0) * (0.5 + (words >> 28).float()) * 0.5).view(n, 8, 1, 1)
    shifts = torch.arange(0, 28, 7, device=blocks.device)
    signs = _ksigned((words.unsqueeze(-1) >> shifts) & 0x7F)  # [N, S, 4, 8]
    grid = _grid(Q.IQ3_XXS, blocks.device)[blocks[:, 2:66].long()].view(n, 8, 4, 8)
    return (db * grid * signs).view(n, 256)


def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 110] -> [N, 256]: fp16 d, 64 low index bytes, 8 bytes of high index bits, 32 sign
    bytes, 4 bytes of two 4-bit scales (points of 4)."""
    n = blocks.shape[0]
    scales = torch.stack((blocks[:, 106:110] & 0x0F, blocks[:, 106:110] >> 4), -1).view(n, 8)
    db = (_half(blocks, 0) * (1 + 2 * scales).float()).view(n, 8, 1, 1)
    signs = _signs(_bits(blocks[:, 74:106])).view(n, 8, 4, 8)
    index = blocks[:, 2:66].long() | (_bits(blocks[:, 66:74]).view(n, 64).long() << 8)
    grid = _grid(Q.IQ3_S, blocks.device)[index].view(n, 8, 4, 8)
    return (db * grid * signs).view(n, 256)


def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 50] -> [N, 256]: fp16 d, 32 low index bytes, 8 uint16 (4 x 3 high index bits,
    3-bit scale, delta sign)."""
    n = blocks.shape[0]
    qh = _u16(blocks, 34, 50)  # [N, S=8]
    dl = (_half(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).view(n, 8, 1, 1)
    shifts = torch.arange(0, 12, 3, device=blocks.device)
    high = ((qh.unsqueeze(-1) >> shifts) & 7).view(n, 32)
    index = blocks[:, 2:34].long() | (high.long() << 8)
    grid = _grid(Q.IQ1_S, blocks.device)[index].view(n, 8, 4, 8)
    return (dl * (grid + delta)).view(n, 256)


def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 56] -> [N, 256]: 32 low index bytes, 16 bytes of (3 high index bits, delta sign) x 2,
    4 uint16 of 3-bit scales whose top nibbles together are the fp16 d."""
    n = blocks.shape[0]
    words = _u16(blocks, 48, 56)  # [N, 4]
    shifts = torch.arange(12, -1, -4, device=blocks.device)
    bits = (((words & 0xF000) >> shifts).sum(-1)).to(torch.int16)  # disjoint nibbles: | as +
    d = bits.view(torch.float16).float().view(n, 1)
    scale_shifts = torch.arange(0, 12, 3, device=blocks.device)
    scales = ((words.unsqueeze(-1) >> scale_shifts) & 7).view(n, 16)
    dl = (d * (2 * scales + 1).float()).view(n, 8, 2, 1, 1)
    qh = torch.stack((blocks[:, 32:48] & 0x0F, blocks[:, 32:48] >> 4), -1).view(n, 32)
    index = blocks[:, :32].long() | ((qh & 7).long() << 8)
    delta = torch.where((qh & 8) == 0, 0.125, -0.125).view(n, 8, 2, 2, 1)
    grid = _grid(Q.IQ1_M, blocks.device)[index].view(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).view(n, 256)


IQ_DEQUANTIZERS = {int(Q.IQ2_XXS): _iq2_xxs, int(Q.IQ2_XS): _iq2_xs, int(Q.IQ2_S): _iq2_s,
                   int(Q.IQ3_XXS): _iq3_xxs, int(Q.IQ3_S): _iq3_s, int(Q.IQ1_S): _iq1_s,
                   int(Q.IQ1_M): _iq1_m}
