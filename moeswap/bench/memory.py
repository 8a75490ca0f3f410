"""Memory seen from inside a worker: the process's anonymous and file-backed resident bytes
(/proc/self/status) and the expert store's bytes per tier, sampled step by step."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_FIELDS = {"RssAnon": "rss_anon", "RssFile": "rss_file", "VmHWM": "peak_rss"}


def process_memory() -> dict[str, int]:
    """{rss_anon, rss_file, peak_rss} in bytes; where /proc is missing (macOS) only peak_rss,
    from getrusage."""
    if not _STATUS.exists():
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"peak_rss": peak if sys.platform == "darwin" else peak * 1024}
    found = {}
    for line in _STATUS.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in _FIELDS:
            found[_FIELDS[key]] = int(value.split()[0]) * 1024  # the file says kB
    return found


def tier_bytes(store_stats: dict) -> dict[str, int]:
    """Bytes each tier holds now: what is charged to it (shared weights, KV cache, staging) plus
    its resident experts -- not its preallocated slots, so the curve shows residency."""
    held = {}
    for tier, s in store_stats.get("tiers", {}).items():
        charged = s["held_bytes"] - s["slots"] * s["slot_bytes"]
        held[tier] = charged + s["experts_resident"] * s["slot_bytes"]
    return held


class MemoryTrace:
    """Samples taken at the steps a runner chooses (after load, each prefill piece, each
    decode step); ``stats`` reads the expert store's stats, None for engines without one."""

    def __init__(self, stats: Any = None):
        self.stats = stats
        self.started = time.perf_counter()
        self.samples: list[dict] = []

    def sample(self, step: str) -> None:
        row = {"step": step, "t": round(time.perf_counter() - self.started, 4), **process_memory()}
        if self.stats is not None:
            row["tiers"] = tier_bytes(self.stats())
        self.samples.append(row)

    def peaks(self) -> dict:
        """Peak anonymous bytes sampled, the kernel's peak RSS, and peak bytes per tier."""
        tiers: dict[str, int] = {}
        for row in self.samples:
            for tier, held in row.get("tiers", {}).items():
                tiers[tier] = max(tiers.get(tier, 0), held)
        anon = [row["rss_anon"] for row in self.samples if "rss_anon" in row]
        return {"peak_anon_bytes": max(anon) if anon else None,
                "peak_rss_bytes": max(row["peak_rss"] for row in self.samples),
                "peak_tier_bytes": tiers or None}
