"""The tier bandwidths a plan predicts speed from: flags, else ``moeswap probe``'s cache, else
stated conservative defaults; and the fixed costs they miss (a cold read's latency, a block's
and an expert's step work) from the same cache, else stated defaults. Reading the cache never
measures (``moeswap probe`` does)."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from moeswap.experts.cost import Rates
from moeswap.planner.probe import DEFAULT_CACHE, Overheads, read_cache, read_overheads

# Conservative, in bytes per second: a SATA-class SSD read cold, a 2-core product over stored
# bytes (well under the 46 GB/s `moeswap probe` measured here, docs/BENCHMARKS.md), PCIe 3.0
# x16 as used, and a consumer GPU's product over quantized bytes well under its memory bandwidth.
DEFAULT_RATES = Rates(disk_read=0.5e9, link=10e9, host_compute=8e9, device_compute=300e9)
# Conservative fixed costs: a cold read waits 0.2 ms before its bytes flow (a SATA SSD's random
# read; then disk_read); a block of a decode step costs 0.5 ms of torch work and each expert the
# store serves 0.1 ms (this runtime's Python on a slow core; probe.cached_overheads measures).
DEFAULT_OVERHEADS = Overheads(read_seconds=((0, 0.2e-3),), layer_step=0.5e-3, expert_call=0.1e-3)


@dataclass(frozen=True)
class PlanRates:
    rates: Rates
    source: str  # where each came from (the fixed costs too), for the table
    overheads: Overheads = field(default=DEFAULT_OVERHEADS)

    def read_seconds(self, n_bytes: int) -> float:
        """One cold read of ``n_bytes``: linear between the probe's two nearest read sizes (each
        segment a latency + bytes / bandwidth); the smallest size's time below it; beyond the
        largest, its time + the rest at ``disk_read``."""
        points = self.overheads.read_seconds
        if n_bytes <= points[0][0]:
            return points[0][1]
        for (size_a, time_a), (size_b, time_b) in zip(points, points[1:]):
            if n_bytes <= size_b:
                return time_a + (time_b - time_a) * (n_bytes - size_a) / (size_b - size_a)
        size, seconds = points[-1]
        return seconds + (n_bytes - size) / self.rates.disk_read


def probe_cache_rates(cache: Path = DEFAULT_CACHE, threads: str = "all") -> Rates | None:
    """This host's rates from the probe cache: those measured with ``threads`` ("all" or a
    count) first, else any thread count's."""
    return _this_host(read_cache(cache), threads)


def probe_cache_overheads(cache: Path = DEFAULT_CACHE, threads: str = "all") -> Overheads | None:
    """This host's fixed costs from the probe cache, chosen as ``probe_cache_rates`` chooses."""
    return _this_host(read_overheads(cache), threads)


def _this_host(by_key: dict, threads: str):
    mine = {count: value for (host, count), value in by_key.items() if host == platform.node()}
    return mine.get(threads) or mine.get("all") or next(iter(mine.values()), None)


def plan_rates(overrides: dict[str, float | None], cache: Path = DEFAULT_CACHE,
               threads: str = "all") -> PlanRates:
    """``overrides``: Rates field -> bytes/s given on the command line (None: not given);
    ``threads``: the probe entry to prefer ("all", or the run's ``--threads``)."""
    cached = probe_cache_rates(cache, threads)
    base, source = (cached, f"moeswap probe ({cache})") if cached else \
        (DEFAULT_RATES, "conservative defaults (run `moeswap probe` to measure)")
    given = {name: value for name, value in overrides.items() if value is not None}
    unknown = set(given) - {f.name for f in fields(Rates)}
    if unknown:
        raise ValueError(f"not a rate: {sorted(unknown)}")
    if given:
        source += "; given: " + ", ".join(sorted(given))
    overheads = probe_cache_overheads(cache, threads)
    if overheads is None:
        return PlanRates(replace(base, **given), source + "; read latency and step costs: "
                         "conservative defaults (not measured on this machine yet)")
    return PlanRates(replace(base, **given), source + "; read latency and step costs: moeswap "
                     "probe", overheads)
