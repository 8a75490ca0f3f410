"""What the engine asks of a weight source: canonical (llama.cpp GGUF) names in, float32 out.

Two sources implement it: ``GGUFWeights`` (a .gguf file) and ``SafetensorsWeights`` (a HF
folder, renamed through ``hf_names``). Nothing is read until a tensor is asked for, and a
routed expert can be read alone as (layer, expert, kind) with kind in gate / up / down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TensorDescription:
    name: str  # canonical GGUF name
    shape: tuple[int, ...]  # torch order (outermost first)
    type_name: str  # stored type: F32, Q8_0, BF16, ...
    location: str  # where the stored bytes are: "file.gguf @ offset" or "shard.safetensors"
    zero_copy: bool  # True when tensor() returns a view of the mapped file, not a new buffer


class WeightSource(Protocol):
    def has(self, name: str) -> bool: ...

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor as float32, torch order (GGUF ne reversed)."""

    def expert(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        """One routed expert's matrix [out, in] as float32; reads only that expert's bytes."""

    def experts(self, layer: int, kind: str) -> torch.Tensor:
        """All routed experts of a layer stacked [E, out, in] as float32."""

    def describe(self, name: str) -> TensorDescription: ...
