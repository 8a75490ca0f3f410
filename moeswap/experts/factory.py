"""What the model loader calls to build the expert store (``expert_runner``)."""

from __future__ import annotations

from moeswap.experts.store import ExpertStore, StoreOptions
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.quant import CpuKernels


class StoreFactory:
    """Builds the store when the loader asks (``expert_runner``) and keeps it for ``stats``."""

    def __init__(self, options: StoreOptions):
        self.options = options
        self.store: ExpertStore | None = None

    def __call__(self, gguf: GGUFFile, kernels: CpuKernels, layers: list[int],
                 activation: str) -> ExpertStore:
        routers = None
        if self.options.prefetch in ("gate", "both"):
            from moeswap.formats.gguf_weights import GGUFWeights
            from moeswap.models.causal_lm import router

            config, weights = config_from_gguf(gguf), GGUFWeights(gguf)
            routers = {i: router(config, weights, i) for i in layers}
        self.store = ExpertStore(gguf, kernels, layers, activation, self.options, routers)
        return self.store

    def stats(self) -> dict:
        return self.store.stats() if self.store is not None else {}
