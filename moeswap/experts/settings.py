"""The expert store's settings: budgets, policy, miss handling, approximations and prefetch.

Typed once here; the command line's flags become one of these in ``moeswap.cli.offload_args``.
"""

from __future__ import annotations

from dataclasses import dataclass

PREDICTORS = ("off", "gate", "history", "both")  # --prefetch: moeswap.experts.prefetch
COLD_READS_MODES = ("auto", "on", "off")  # --cold-reads (bare: on): moeswap.planner.cold_reads
# --miss-lowbit: the types a low-bit copy can take (moeswap.experts.lowbit); ggml quantizes
# each without an importance matrix.
LOWBIT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                "iq4_nl")


@dataclass(frozen=True)
class OffloadSettings:
    host_bytes: int  # budget of the host tier; what moeswap.memory.HostCharge sums counts in it
    device_bytes: int = 0  # budget of the device tier (0: no device slots)
    policy: str = "lru"
    miss: str = "auto"
    threshold: float = 0.0  # --expert-threshold: drop picks weighted under it (approximation)
    cold_reads: bool = False  # read past the page cache (O_DIRECT, else pread + DONTNEED)
    # --read-depth: disk reads in flight at once (moeswap.experts.disk_reads); 4 keeps an NVMe
    # drive's queue busy with megabyte reads and leaves the cores to the kernels
    read_depth: int = 4
    # "ram": device slots are RAM computed by the CPU kernels (a CPU-only machine's device form);
    # a torch device ("cuda", or "cpu" to test that path): slots there, products computed there.
    device_backend: str = "ram"
    prefetch: str = "off"  # --prefetch: off, gate, history or both (moeswap.experts.prefetch)
    prefetch_depth: int = 1  # --prefetch-depth: how many MoE layers ahead to guess
    miss_lowbit: str = ""  # --miss-lowbit TYPE: serve unadmitted misses from low-bit copies
