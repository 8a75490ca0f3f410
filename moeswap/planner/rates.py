"""The tier bandwidths a plan predicts speed from: flags, else ``moeswap probe``'s cache, else
stated conservative defaults. Reading the cache never measures (``moeswap probe`` does)."""

from __future__ import annotations

import platform
from dataclasses import dataclass, fields, replace
from pathlib import Path

from moeswap.experts.cost import Rates
from moeswap.experts.probe import DEFAULT_CACHE, read_cache

# Conservative, in bytes per second: a SATA-class SSD read cold, a 2-core product over stored
# bytes (docs/OFFLOAD.md: this machine's ggml kernels reach ~10 GB/s), PCIe 3.0 x16 as used, and
# a consumer GPU's product over quantized bytes well under its memory bandwidth.
DEFAULT_RATES = Rates(disk_read=0.5e9, link=10e9, host_compute=8e9, device_compute=300e9)


@dataclass(frozen=True)
class PlanRates:
    rates: Rates
    source: str  # where each came from, for the table


def probe_cache_rates(cache: Path = DEFAULT_CACHE) -> Rates | None:
    """This host's rates from the probe cache (any thread count; the one for all threads first)."""
    mine = {threads: rates for (host, threads), rates in read_cache(cache).items()
            if host == platform.node()}
    return mine.get("all") or next(iter(mine.values()), None)


def plan_rates(overrides: dict[str, float | None], cache: Path = DEFAULT_CACHE) -> PlanRates:
    """``overrides``: Rates field -> bytes/s given on the command line (None: not given)."""
    cached = probe_cache_rates(cache)
    base, source = (cached, f"moeswap probe ({cache})") if cached else \
        (DEFAULT_RATES, "conservative defaults (run `moeswap probe` to measure)")
    given = {name: value for name, value in overrides.items() if value is not None}
    unknown = set(given) - {f.name for f in fields(Rates)}
    if unknown:
        raise ValueError(f"not a rate: {sorted(unknown)}")
    if given:
        source += "; given: " + ", ".join(sorted(given))
    return PlanRates(replace(base, **given), source)
