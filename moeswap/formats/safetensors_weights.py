"""Lazy float32 tensors from a Hugging Face folder (config.json + sharded *.safetensors).

Tensors are served under their llama.cpp GGUF names (``hf_names``), already in GGUF layout
(Q/K permuted, Gemma norms shifted), so the engine cannot tell this source from a converted
file. ``safe_open`` maps the shards; a tensor is read when asked, and one routed expert reads
only its own HF tensor (or its slice of a stacked one).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from moeswap.errors import MoeswapError
from moeswap.formats import hf_names
from moeswap.formats.config import ModelConfig, config_from_hf
from moeswap.formats.weights import TensorDescription

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsWeights:
    def __init__(self, folder: str | Path, config: ModelConfig | None = None):
        self.folder = Path(folder)
        self.config = config or config_from_hf(self.folder)
        self._shard_of = _shard_map(self.folder)
        self._handles: dict[str, object] = {}
        self.plan = hf_names.plan(self._shard_of, self.config.arch, self.config.n_layer)

    def names(self) -> list[str]:
        return list(self.plan)

    def has(self, name: str) -> bool:
        return name in self.plan

    def is_mxfp4(self, name: str) -> bool:
        """Whether the GGUF tensor comes from MXFP4 ``*_blocks`` / ``*_scales`` (GPT-OSS)."""
        return "mxfp4" in self._parts(name)[0].ops

    def mxfp4_bytes(self, name: str) -> torch.Tensor:
        """The GGUF tensor's ggml MXFP4 bytes [E, out, in/32*17] uint8, repacked, not decoded."""
        part = self._parts(name)[0]
        scales = part.hf_name.removesuffix("_blocks") + hf_names.MXFP4_SCALES_SUFFIX
        if scales not in self._shard_of:
            raise MoeswapError(f"{self.folder}: '{part.hf_name}' has no '{scales}'")
        return hf_names.mxfp4_to_ggml(self._handle(part.hf_name).get_tensor(part.hf_name),
                                      self._handle(scales).get_tensor(scales), part.ops)

    def tensor(self, name: str) -> torch.Tensor:
        parts = self._parts(name)
        if "mxfp4" in parts[0].ops:
            raise MoeswapError(f"{self.folder}: '{parts[0].hf_name}' holds MXFP4 experts, which "
                               "moeswap computes from their stored bytes, never as floats")
        if parts[0].expert is not None:
            return torch.stack([self._read(p) for p in parts])  # [E, out, in]
        return self._read(parts[0])

    def expert(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        name, rows = self._expert_source(layer, kind)
        parts = self._parts(name)
        if parts[0].expert is not None:
            if not 0 <= expert < len(parts):
                raise MoeswapError(f"{self.folder}: expert {expert} out of range "
                                   f"(layer {layer} has {len(parts)} experts)")
            return self._read(parts[expert])[rows]
        part = parts[0]  # stacked [E, out, in]: read only row `expert`
        w = self._handle(part.hf_name).get_slice(part.hf_name)[expert]
        return self._finish(hf_names.select_part(w, part.ops), part)[rows]

    def experts(self, layer: int, kind: str) -> torch.Tensor:
        name, rows = self._expert_source(layer, kind)
        return self.tensor(name)[:, rows]  # [E, out, in]

    def _expert_source(self, layer: int, kind: str) -> tuple[str, slice]:
        """The GGUF tensor holding `kind`, and its rows: half of a fused gate_up (gate first)."""
        name = f"blk.{layer}.ffn_{kind}_exps.weight"
        fused = f"blk.{layer}.ffn_gate_up_exps.weight"
        if kind == "down" or name in self.plan or fused not in self.plan:
            return name, slice(None)
        half = self.tensor_shape(fused)[-2] // 2
        return fused, slice(0, half) if kind == "gate" else slice(half, 2 * half)

    def describe(self, name: str) -> TensorDescription:
        parts = self._parts(name)
        first = self._handle(parts[0].hf_name).get_slice(parts[0].hf_name)
        shape = tuple(self.tensor_shape(name))
        return TensorDescription(name, shape, first.get_dtype(),
                                 self._shard_of[parts[0].hf_name], zero_copy=False)

    def tensor_shape(self, name: str) -> list[int]:
        """The GGUF tensor's shape in torch order, from the headers only (ops run on meta)."""
        parts = self._parts(name)
        header = self._handle(parts[0].hf_name).get_slice(parts[0].hf_name).get_shape()
        if "mxfp4" in parts[0].ops:  # blocks [E, R, B, 16] -> elements [E, R', B*32]
            rows = header[-3] // 2 if {"even", "odd"} & parts[0].ops else header[-3]
            return [*header[:-3], rows, header[-2] * 32]
        meta = torch.empty(header, device="meta")
        shape = list(self._finish(hf_names.select_part(meta, parts[0].ops), parts[0]).shape)
        return [len(parts), *shape] if parts[0].expert is not None else shape

    def _parts(self, name: str) -> list[hf_names.Part]:
        parts = self.plan.get(name)
        if parts is None:
            raise MoeswapError(f"{self.folder}: no tensor maps to '{name}'; "
                               "the checkpoint is incomplete or not of this architecture")
        return parts

    def _read(self, part: hf_names.Part) -> torch.Tensor:
        w = self._handle(part.hf_name).get_tensor(part.hf_name)
        return self._finish(hf_names.select_part(w, part.ops), part)

    def _finish(self, w: torch.Tensor, part: hf_names.Part) -> torch.Tensor:
        w = hf_names.transform(w, part.ops, self.config)
        return w.to(torch.float32).contiguous()

    def _handle(self, hf_name: str):
        shard = self._shard_of[hf_name]
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.folder / shard, framework="pt")
        return self._handles[shard]


def _shard_map(folder: Path) -> dict[str, str]:
    """HF tensor name -> shard file name, from the index or from the shards' headers."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        except (json.JSONDecodeError, KeyError) as e:
            raise MoeswapError(f"{index}: not a safetensors index ({e})") from None
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise MoeswapError(f"{folder}: no *.safetensors files; expected a Hugging Face model folder")
    mapping: dict[str, str] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                mapping[name] = shard.name
    return mapping
