"""What the web page's memory panel and tier counts show: the weights, the KV caches and the
host budget (the whole panel for a dense model, which has no expert grid), and per tier the
experts held against its slots.

``memory_view`` is computed once per runtime and batch options (it walks the file's tensor
index), ``tier_counts`` on every poll, from the store's own stats.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from moeswap.memory import HostCharge
from moeswap.models.loader import KV_DTYPES
from moeswap.server.batching import BatchOptions

_KV_TYPE_NAMES = {dtype: name for name, dtype in KV_DTYPES.items()}  # kv_dtype -> --kv-type


@lru_cache(maxsize=8)  # one server has one runtime; a test process makes a few
def memory_view(runtime: Any, batch: BatchOptions) -> dict:
    """Bytes of the weights (shared and routed experts; None for a Hugging Face folder), of
    the KV caches of --max-batch contexts of --ctx positions and a step's working memory (as
    the host budget charges them), and the host budget (None: no --host-mem, all in RAM)."""
    config = runtime.config
    kv_type = _KV_TYPE_NAMES.get(getattr(runtime.model, "kv_dtype", None), "f32")
    charge = HostCharge.for_batch(batch.ctx, batch.max_batch, batch.step_tokens, kv_type)
    shared, routed = _weight_bytes(getattr(runtime.model, "source", None))
    host = runtime.stats().get("tiers", {}).get("host")
    return {"dense": not config.moe_layers, "shared_bytes": shared, "expert_bytes": routed,
            "kv_bytes": charge.kv_bytes(config), "kv_type": kv_type,
            "working_bytes": charge.working_bytes(config), "contexts": batch.max_batch,
            "ctx": batch.ctx, "budget_bytes": host["budget_bytes"] if host else None}


def tier_counts(runtime: Any, stats: dict) -> dict:
    """Per tier: experts held and slots; without a store, every expert in the mapped file."""
    if "tiers" not in stats:
        config = runtime.config
        n = len(config.moe_layers) * config.n_expert
        return {"mapped": {"held": n, "slots": n}} if n else {}
    return {tier: {"held": s["experts_resident"], "slots": s["slots"]}
            for tier, s in stats["tiers"].items()}


def _weight_bytes(source: Any) -> tuple[int | None, int | None]:
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.planner.sizes import model_sizes

    if not isinstance(source, GGUFFile):
        return None, None
    sizes = model_sizes(source)
    return sizes.shared_bytes, sizes.routed_bytes
