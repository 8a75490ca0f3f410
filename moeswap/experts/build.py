"""build_store: the expert store's settings, charge and rates -> what the model loader calls
to build the store (``load_model(expert_runner=...)``), kept for its ``stats``."""

from __future__ import annotations

from moeswap.errors import MoeswapError
from moeswap.experts.cost import Rates
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.store import ExpertStore
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_weights import GGUFWeights
from moeswap.memory import HostCharge
from moeswap.models.causal_lm import router
from moeswap.quant import CpuKernels


class StoreBuilder:
    """Builds the store when the loader asks and keeps it for ``stats``."""

    def __init__(self, settings: OffloadSettings, charge: HostCharge, rates: Rates | None):
        self.settings, self.charge, self.rates = settings, charge, rates
        self.store: ExpertStore | None = None

    def __call__(self, gguf: GGUFFile, kernels: CpuKernels, layers: list[int],
                 activation: str) -> ExpertStore:
        if not layers:
            raise MoeswapError(f"{gguf.path}: this {gguf.architecture} model is dense (no routed "
                               "experts), so there is no expert store to budget; drop --host-mem "
                               "and --device-mem: its weights all stay in RAM")
        routers = None
        if self.settings.prefetch in ("gate", "both"):  # the gate predictor runs them ahead
            config, weights = config_from_gguf(gguf), GGUFWeights(gguf)
            routers = {i: router(config, weights, i) for i in layers}
        self.store = ExpertStore(gguf, kernels, layers, activation, self.settings, self.charge,
                                 self.rates, routers)
        return self.store

    def stats(self) -> dict:
        return self.store.stats() if self.store is not None else {}


def build_store(settings: OffloadSettings, charge: HostCharge = HostCharge(),
                rates: Rates | None = None) -> StoreBuilder:
    """The expert runner for ``load_model``: a store under ``settings`` whose host budget pays
    ``charge``; ``rates``: measured rates for the cost model (None: a CPU-only machine's).
    Give ``load_model`` the charge's context and step sizes too, so caches match it."""
    return StoreBuilder(settings, charge, rates)


def load_options(settings: OffloadSettings | None, charge: HostCharge,
                 rates: Rates | None = None) -> dict:
    """``moeswap.runtime.load``'s options for a store under ``settings`` (None: all resident,
    nothing charged, but the caches still of the charge's type): the store paying
    ``charge``, and the charge's sizes and type for the caches."""
    if settings is None:
        return dict(kv_type=charge.kv_type)
    return dict(expert_runner=build_store(settings, charge, rates), kv_type=charge.kv_type,
                context_tokens=charge.context_tokens, step_tokens=charge.step_tokens)
