"""The device tier on a torch device: slots in device memory, uploads through a pinned staging
ring on a copy stream, and the products computed there from the stored bytes.

``TorchDeviceSlots`` is written for CUDA and runs the same code on CPU tensors (``device="cpu"``),
which is how it is tested here: the copies go through a small interface (``CudaCopies`` on CUDA,
``SyncCopies`` on CPU, where a copy is done when it returns; tests hand in one that defers
copies until their event is waited on). On CUDA:

- the pool is one ``uint8`` tensor in device memory, allocated once and cut into slots;
- an upload copies the expert's bytes into the next buffer of a small ring of pinned host
  buffers (after that buffer's previous copy has finished, its event), then copies it to the
  slot on a dedicated copy stream and records an event; the compute stream waits on that event
  before it first reads the slot, so uploads overlap with compute without ever racing it; the
  copy stream first waits for the compute stream's work so far, so a slot is rewritten only
  after its last reader. Prefetch (moeswap.experts.store) uploads guessed experts this way
  ahead of their layer;
- products dequantize the expert's matrix on the device (moeswap.experts.device_dequant, bit
  for bit gguf-py's values) and multiply in float32, with the activations rounded first the
  way ggml's CPU rounds them for that weight type (its ``vec_dot_type``: fp16 for F16, Q8_0
  blocks for Q8_0 / Q4_0 / Q5_0 / MXFP4, Q8_K blocks for the K-quants), so that device and CPU
  results differ only by float summation order (and, for Q8_K, by rounding each activation's
  q * d to float32, which ggml never forms: an error of the same size).

Types: ``DEVICE_TYPES``, the keys of ``ACTIVATION_ROUNDING``: F32, F16, Q8_0, Q4_0, Q5_0, MXFP4,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and the grids IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
(Q8_K activations, as the K-quants). A model with other expert types (Q4_1 / Q5_1, whose Q8_1
activations carry an fp16 sum the min term uses; IQ4_NL, IQ4_XS, TQ1_0, TQ2_0) keeps its experts
off the device (the store refuses ``--device-mem`` for it).

Legend: M rows (tokens) of one expert, I input width, O output width, B blocks per row.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from moeswap.experts.device_dequant import dequantize
from moeswap.experts.tiers import FreeSlots, slot_pieces
from moeswap.models.quant_experts import VECTOR_DTYPES, ExpertLayout


def round_to_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Rows [M, I] rounded to Q8_0 blocks as ggml's x86 quantize_row_q8_0 (AVX2) rounds them:
    d = amax / 127 kept as fp16, q = x * (127 / amax) rounded half to even."""
    blocks = x.view(x.shape[0], -1, 32)  # [M, B, 32]
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # [M, B, 1]
    full = torch.full_like(amax, 127.0)  # divide by a tensor: CUDA's tensor / float is x * (1/f)
    inverse = torch.where(amax > 0, full / amax, torch.zeros_like(amax))
    d = (amax / full).half().float()
    return (torch.round(blocks * inverse) * d).view_as(x)


def round_to_q8_k(x: torch.Tensor) -> torch.Tensor:
    """Rows [M, I] rounded to Q8_K blocks of 256 as ggml's quantize_row_q8_K_ref does (its x86
    CPU code calls it): max = the block's first value of largest magnitude, with its sign;
    iscale = -127 / max; q = min(127, nearest_int(iscale * x)) (half to even); d = 1 / iscale as
    float32; an all-zero block stays zero. Returns q * d rounded to float32."""
    blocks = x.view(x.shape[0], -1, 256)  # [M, B, 256]
    first = blocks.abs().argmax(dim=-1, keepdim=True)  # [M, B, 1]: the first largest, as ggml
    signed_max = blocks.gather(-1, first)  # [M, B, 1]
    iscale = torch.full_like(signed_max, -127.0) / signed_max  # [M, B, 1]
    q = torch.round(blocks * iscale).clamp(max=127)  # [M, B, 256]
    d = torch.ones_like(iscale) / iscale  # [M, B, 1]
    return torch.where(signed_max != 0, q * d, torch.zeros_like(q)).view_as(x)


def _unrounded(x: torch.Tensor) -> torch.Tensor:
    return x


def _round_to_f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


# How ggml's CPU rounds a product's activations for each weight type: its vec_dot_type
# (type_traits_cpu in ggml-cpu.c): F32 none, F16 fp16, Q8_0 for Q4_0 / Q5_0 / Q8_0 / MXFP4,
# Q8_K for the K-quants and the IQ1-IQ3 grids.
ACTIVATION_ROUNDING = {
    int(Q.F32): _unrounded, int(Q.F16): _round_to_f16,
    **{int(t): round_to_q8_0 for t in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.MXFP4)},
    **{int(t): round_to_q8_k for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ1_S, Q.IQ1_M,
                                       Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S)},
}
DEVICE_TYPES = frozenset(ACTIVATION_ROUNDING)


def device_type_names() -> str:
    """The device tier's types by name, for messages: 'F32, F16, Q4_0, ...'."""
    return ", ".join(Q(t).name for t in sorted(DEVICE_TYPES))


class _DeviceMatrix:
    """One expert matrix in a device slot, with the one-expert-stack call shape of ggml's."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, ne: tuple[int, int]):
        self.raw, self.ggml_type, (self.in_features, self.out_features) = raw, ggml_type, ne

    def matmul(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [M, I] (ids: [M, 1], all 0) -> [M, 1, O] on the CPU, like QuantExperts.matmul."""
        w = dequantize(self.raw, self.ggml_type, self.out_features, self.in_features)  # [O, I]
        x = ACTIVATION_ROUNDING[self.ggml_type](x.to(self.raw.device, torch.float32))  # [M, I]
        return F.linear(x, w)[:, None].cpu()  # [M, 1, O]


class DeviceExpert:
    """An expert's pieces in a device slot, in the interface the store computes with."""

    def __init__(self, layout: ExpertLayout, slot: torch.Tensor):
        self.matrices: dict[str, _DeviceMatrix] = {}
        self.biases: dict[str, torch.Tensor] = {}
        for kind, part, raw in slot_pieces(layout, slot):
            if part.is_matrix:
                self.matrices[kind] = _DeviceMatrix(raw, part.ggml_type, part.ne)
            else:
                self.biases[kind] = raw.view(VECTOR_DTYPES[part.ggml_type]).view(-1).cpu()


class CudaCopies:
    """Host-to-device copies on a dedicated stream, each ending in an event."""

    def __init__(self, device: torch.device):
        self.device, self.stream = device, torch.cuda.Stream(device)

    def copy(self, target: torch.Tensor, source: torch.Tensor):
        """Start the copy -> its event."""
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)  # the slot's last reader has finished with it
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def compute_waits(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class SyncCopies:
    """CPU tensors: a copy is done when it returns, so it needs no event."""

    def copy(self, target: torch.Tensor, source: torch.Tensor):
        target.copy_(source)

    def compute_waits(self, event) -> None:
        pass


class TorchDeviceSlots(FreeSlots):
    """A pool of expert slots on a torch device, filled through a pinned staging ring."""

    def __init__(self, device: str, n_slots: int, slot_size: int, ring: int = 2):
        super().__init__(n_slots)
        self.device = torch.device(device)
        self.n_slots, self.slot_size = n_slots, slot_size
        self.nbytes = n_slots * slot_size
        self.pool = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        cuda = self.device.type == "cuda"
        self.ring = [torch.empty(slot_size, dtype=torch.uint8, pin_memory=cuda)
                     for _ in range(ring)]
        self._ring_events: list = [None] * ring
        self._next = 0
        self.copies = CudaCopies(self.device) if cuda else SyncCopies()
        self.copy_stream = self.copies.stream if cuda else None  # to time the uploads
        self._ready: dict[int, object] = {}  # slot -> event of its last upload, until first read

    def slot(self, index: int) -> torch.Tensor:
        return self.pool[index * self.slot_size:(index + 1) * self.slot_size]

    def upload(self, index: int, source: np.ndarray) -> None:
        """Start copying ``source`` (a host slot) into device slot ``index``."""
        i, self._next = self._next, (self._next + 1) % len(self.ring)
        if self._ring_events[i] is not None:
            self._ring_events[i].synchronize()  # the buffer's previous upload has left it
        self.ring[i].numpy()[:] = source
        event = self.copies.copy(self.slot(index), self.ring[i])
        self._ring_events[i] = event
        self._ready.pop(index, None)
        if event is not None:
            self._ready[index] = event

    def expert(self, index: int, layout: ExpertLayout) -> DeviceExpert:
        """The slot's expert, once its upload is done (the compute stream waits for it)."""
        event = self._ready.pop(index, None)
        if event is not None:
            self.copies.compute_waits(event)
        return DeviceExpert(layout, self.slot(index))
