"""/metrics in Prometheus' text format (version 0.0.4), written out by hand.

The server's own series are always there. The expert-store series appear only when the model
was loaded with an expert store (``moeswap serve --host-mem ...``): they come from the
runtime's ``stats()`` (moeswap.experts.store.ExpertStore.stats), which is empty without one.
"""

from __future__ import annotations

from typing import Any, Iterable

from moeswap.server.batching import BatchScheduler


class HttpCounts:
    """Responses by path and status code, counted by the app's middleware."""

    def __init__(self):
        self.by_route: dict[tuple[str, int], int] = {}

    def add(self, path: str, status: int) -> None:
        key = (path, status)
        self.by_route[key] = self.by_route.get(key, 0) + 1


def _series(name: str, kind: str, help: str, samples: Iterable[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]
    return lines


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def render_metrics(scheduler: BatchScheduler, http: HttpCounts, store_stats: dict[str, Any]) -> str:
    c = scheduler.counters
    lines = []
    lines += _series("moeswap_requests_total", "counter", "HTTP responses by path and status code",
                     [(f'{{path="{path}",code="{code}"}}', n)
                      for (path, code), n in sorted(http.by_route.items())])
    lines += _series("moeswap_generations_total", "counter",
                     "generation requests ended, by finish reason (stop, length, cancelled, error)",
                     [(f'{{reason="{reason}"}}', n) for reason, n in sorted(c.requests_finished.items())])
    lines += _series("moeswap_rejected_total", "counter", "requests refused because the queue was full",
                     [("", c.requests_rejected)])
    lines += _series("moeswap_queue_depth", "gauge", "requests waiting to join the batch",
                     [("", scheduler.queue_depth)])
    lines += _series("moeswap_batch_size", "gauge", "requests being decoded together",
                     [("", scheduler.active_count)])
    lines += _series("moeswap_prompt_tokens_total", "counter", "prompt tokens received",
                     [("", c.prompt_tokens)])
    lines += _series("moeswap_cached_tokens_total", "counter",
                     "prompt tokens reused from a slot's kept KV cache, not prefilled",
                     [("", c.cached_tokens)])
    lines += _series("moeswap_generated_tokens_total", "counter", "tokens generated",
                     [("", c.generated_tokens)])
    lines += _series("moeswap_tokens_per_second", "gauge",
                     "tokens generated per second of wall time, over the last 10 s",
                     [("", c.tokens_per_second())])
    lines += _series("moeswap_busy_seconds_total", "counter", "time spent in forward steps",
                     [("", c.busy_seconds)])
    if "total" in store_stats:  # a store's stats (replayed routing alone adds only "routing")
        lines += _store_series(store_stats)
    return "\n".join(lines) + "\n"


def _store_series(stats: dict[str, Any]) -> list[str]:
    t = stats["total"]
    tiers = stats["tiers"]
    lines = []
    lines += _series("moeswap_expert_requests_total", "counter", "routed experts asked for",
                     [("", t["requests"])])
    lines += _series("moeswap_expert_hits_total", "counter", "experts found resident, by tier",
                     [('{tier="device"}', t["device_hits"]), ('{tier="host"}', t["host_hits"])])
    lines += _series("moeswap_expert_hit_rate", "gauge", "hits / requests since start",
                     [("", t["hit_rate"])])
    lines += _series("moeswap_expert_bytes_moved_total", "counter",
                     "expert bytes read from the model file (disk) or moved up into device slots",
                     [('{from="disk"}', t["disk_bytes"]), ('{from="host"}', t["transfer_bytes"])])
    lines += _series("moeswap_expert_evictions_total", "counter", "experts evicted, by tier",
                     [('{tier="device"}', t["device_evictions"]), ('{tier="host"}', t["host_evictions"])])
    lines += _series("moeswap_expert_stall_seconds_total", "counter", "time waiting on expert loads",
                     [("", t["stall_seconds"])])
    lines += _series("moeswap_tier_resident_bytes", "gauge", "bytes held in each tier",
                     [(f'{{tier="{tier}"}}', s["held_bytes"]) for tier, s in tiers.items()])
    lines += _series("moeswap_tier_budget_bytes", "gauge", "each tier's byte budget",
                     [(f'{{tier="{tier}"}}', s["budget_bytes"]) for tier, s in tiers.items()])
    lines += _series("moeswap_tier_resident_experts", "gauge", "experts resident in each tier",
                     [(f'{{tier="{tier}"}}', s["experts_resident"]) for tier, s in tiers.items()])
    return lines
