"""load_model: a .gguf file or a HF folder -> a ready CausalLM with its expert runner.

Experts are held resident in float32, except MXFP4 experts, which are decoded per expert when
used (a float32 copy would be 8x their stored size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from moeswap.errors import MoeswapError
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_weights import GGUFWeights
from moeswap.formats.safetensors_weights import SafetensorsWeights
from moeswap.models.causal_lm import CausalLM
from moeswap.models.experts import OnUseExperts, ResidentExperts
from moeswap.models.registry import family


class _LoggedWeights:
    """Passes every request through and reports each tensor as it is mapped."""

    def __init__(self, weights: Any, log: Callable[[str], None]):
        self.weights, self.log = weights, log

    def has(self, name: str) -> bool:
        return self.weights.has(name)

    def tensor(self, name: str) -> torch.Tensor:
        self._report(name)
        return self.weights.tensor(name)

    def describe(self, name: str):
        return self.weights.describe(name)

    def expert(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        return self.weights.expert(layer, expert, kind)

    def experts(self, layer: int, kind: str) -> torch.Tensor:
        stacked = self.weights.experts(layer, kind)
        name = f"blk.{layer}.ffn_{kind}_exps.weight"
        if self.weights.has(name):
            self._report(name)
        else:
            self._report(f"blk.{layer}.ffn_gate_up_exps.weight", f" ({kind} half)")
        return stacked

    def _report(self, name: str, note: str = "") -> None:
        d = self.weights.describe(name)
        where = "mapped file (zero-copy)" if d.zero_copy else "RAM (float32)"
        shape = "x".join(str(n) for n in d.shape)
        self.log(f"{name}{note}  {shape}  {d.type_name}  {where}  from {d.location}")


def load_model(path: str | Path, *, verbose_log: Callable[[str], None] | None = None) -> CausalLM:
    """Open a .gguf file or a HF folder (config.json + *.safetensors) and build its model."""
    path = Path(path)
    source: Any
    if path.is_dir():
        weights: Any = SafetensorsWeights(path)
        config, source = weights.config, path
    elif path.exists():
        source = GGUFFile.open(path)
        config = config_from_gguf(source)
        weights = GGUFWeights(source)
    else:
        raise MoeswapError(f"{path}: no such file or folder")
    build = family(config.arch).build
    if verbose_log is not None:
        weights = _LoggedWeights(weights, verbose_log)
    moe_layers = config.moe_layers
    experts: Any
    if any(_stored_type(weights, i) == "MXFP4" for i in moe_layers):
        experts = OnUseExperts(weights, moe_layers, config.expert_act)
    else:
        experts = ResidentExperts.from_weights(weights, moe_layers, config.expert_act)
    return build(config, source, weights, experts)


def _stored_type(weights: Any, layer: int) -> str:
    name = f"blk.{layer}.ffn_down_exps.weight"
    return weights.describe(name).type_name if weights.has(name) else ""
