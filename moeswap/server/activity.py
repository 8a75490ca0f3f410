"""What the web page's expert grid shows: per (MoE layer, expert) its tier and its last use.

``ExpertActivity`` is a routing recorder (moeswap.models.moe.DecisionRecorder): load the model
with it (``moeswap.load(path, recorder=activity)``) and it counts forward steps and notes, per
layer, the last step that routed a token to each expert. ``expert_view`` joins that with where
each expert's bytes are — a device or host slot of the expert store, else the model file on
disk ("disk"); without a store every expert is computed from the mapped file ("mapped") — and
with the counters the page plots. Both are read between steps (BatchScheduler.read_model).
"""

from __future__ import annotations

from typing import Any

import torch

from moeswap.server.batching import BatchScheduler
from moeswap.server.memory_panel import memory_view, tier_counts


class ExpertActivity:
    router_probs = False  # the recorder protocol: no full router distribution wanted

    def __init__(self):
        self.step = 0  # forward calls so far
        self._last: dict[int, torch.Tensor] = {}  # layer -> [X] step of last use, 0: never

    def begin_forward(self, spans, starts, sequences) -> None:
        self.step += 1

    def record(self, layer: int, expert_ids: torch.Tensor, weights: torch.Tensor,
               router_probs: torch.Tensor | None) -> None:
        """expert_ids [N, K]: the experts this step's N tokens picked in ``layer``."""
        ids = expert_ids.reshape(-1).long()  # [N*K]
        last = self._last.get(layer)
        if last is None or last.numel() <= int(ids.max()):  # sized by the ids seen: X unknown here
            grown = torch.zeros(int(ids.max()) + 1, dtype=torch.long)
            if last is not None:
                grown[:last.numel()] = last
            last = self._last[layer] = grown
        last[ids] = self.step  # one indexed write per layer: this runs inside every step

    def last_use(self, layer: int, n_experts: int) -> list[int | None]:
        """Per expert of ``layer``: the last step that used it, or None."""
        last = self._last.get(layer, torch.zeros(0, dtype=torch.long)).tolist()
        return [last[e] if e < len(last) and last[e] else None for e in range(n_experts)]


def _tiers(runtime: Any, layers: list[int], n_experts: int) -> list[list[str]]:
    store = getattr(runtime.expert_runner, "store", None)
    if store is None:
        return [["mapped"] * n_experts for _ in layers]
    where = store.resident_tiers()
    return [[where.get((layer, e), "disk") for e in range(n_experts)] for layer in layers]


def expert_view(runtime: Any, activity: ExpertActivity | None, scheduler: BatchScheduler,
                model_name: str) -> dict:
    """The /v1/moeswap/experts body. Call between steps: it reads the store's slots."""
    config = runtime.config
    layers, n_experts = list(config.moe_layers), config.n_expert
    stats = runtime.stats()
    total = stats.get("total", {})
    c = scheduler.counters
    return {
        "model": model_name,
        "chat": runtime.chat_template is not None,
        "step": activity.step if activity is not None else None,
        "layers": layers,
        "n_experts": n_experts,
        "tier": _tiers(runtime, layers, n_experts),
        "tiers": tier_counts(runtime, stats),  # experts held against each tier's slots
        "memory": memory_view(runtime, scheduler.options),  # weights, KV caches, budget
        "last_use": [activity.last_use(layer, n_experts) if activity is not None
                     else [None] * n_experts for layer in layers],
        "counters": {
            "prompt_tokens": c.prompt_tokens,
            "generated_tokens": c.generated_tokens,
            "tokens_per_second": c.tokens_per_second(),
            "queue_depth": scheduler.queue_depth,
            "batch_size": scheduler.active_count,
            "expert_requests": total.get("requests"),
            "hit_rate": total.get("hit_rate"),
            "disk_bytes": total.get("disk_bytes"),
            "transfer_bytes": total.get("transfer_bytes"),
        },
    }
