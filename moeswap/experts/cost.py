"""The cost model that decides each miss: move the expert up a tier, or compute it where it lies.

Decode is bandwidth-bound, so every cost is bytes over a measured rate (``moeswap probe``):

- compute where it lies: the CPU reads the expert's stored bytes once per token group,
  ``bytes / host_compute`` (a product over quantized bytes runs at the rate the probe measured),
  times ``ceil(tokens / TOKENS_PER_READ)`` since larger groups turn compute-bound;
- transfer: ``bytes / link`` to copy it into a device slot, then ``bytes / device_compute``.

A disk-tier expert must be read into RAM either way, so the disk read is common to both and
does not enter the choice. On a CPU-only machine ``link`` is a RAM copy and
``device_compute == host_compute``, so computing in place is always cheaper, without any
special case. A per-step transfer allowance keeps the link to the share of misses it can
absorb while the CPU computes the rest: in one layer step, transfers may take at most as long as
the in-place computing of all the step's misses would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MISS_MODES = ("auto", "compute", "transfer")
TOKENS_PER_READ = 8  # tokens a product serves per read of its weights before it is compute-bound


@dataclass(frozen=True)
class Rates:
    """Measured rates in bytes per second."""

    disk_read: float  # cold reads of the model file
    link: float  # host RAM -> device slot (a RAM copy on CPU; host-to-device copy on CUDA)
    host_compute: float  # CPU product over stored quantized bytes, one token
    device_compute: float  # the device's product over stored bytes, one token

    def compute_seconds(self, n_bytes: int, n_tokens: int) -> float:
        return n_bytes / self.host_compute * math.ceil(max(n_tokens, 1) / TOKENS_PER_READ)

    def transfer_seconds(self, n_bytes: int, n_tokens: int) -> float:
        return n_bytes / self.link + n_bytes / self.device_compute * math.ceil(
            max(n_tokens, 1) / TOKENS_PER_READ)


class MissPlanner:
    """Chooses per miss, within one layer step, between "compute" and "transfer"."""

    def __init__(self, mode: str, rates: Rates):
        if mode not in MISS_MODES:
            raise ValueError(f"miss mode must be one of {MISS_MODES}, got {mode!r}")
        self.mode, self.rates = mode, rates
        self._allowance = 0.0  # link seconds this step may still spend

    def start_step(self, misses: list[tuple[int, int]]) -> None:
        """misses: (bytes, tokens) of every expert of the step not on the device."""
        self._allowance = sum(self.rates.compute_seconds(b, t) for b, t in misses)

    def choose(self, n_bytes: int, n_tokens: int) -> str:
        if self.mode != "auto":
            return self.mode
        transfer = self.rates.transfer_seconds(n_bytes, n_tokens)
        link = n_bytes / self.rates.link
        if transfer < self.rates.compute_seconds(n_bytes, n_tokens) and link <= self._allowance:
            self._allowance -= link
            return "transfer"
        return "compute"
