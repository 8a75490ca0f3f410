"""`--cold-reads auto` (the default): read experts past the page cache where the process's
memory cgroup has no room for the model file's pages beside the host budget.

A page read through the page cache is charged to the memory cgroup of the process that read it.
A store reading a file the cgroup cannot cache beside the budget's anonymous memory makes the
cgroup reclaim on its reads, over and over (docs/BENCHMARKS.md, "Under the same memory limit");
cold reads (moeswap.experts.direct_io) are charged nothing. Without a limit, or where the file
and the budget fit, reads go through the page cache, where an expert read again is a RAM copy.
The room is the cgroup's as `--plan auto` reads it: the binding level's limit less the anonymous
memory held there (moeswap.planner.cgroup_memory, v1 and v2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moeswap.formats.gguf_file import GGUFFile
from moeswap.planner.cgroup_memory import CgroupLimit, cgroup_limit
from moeswap.planner.placement import gib


@dataclass(frozen=True)
class ColdReads:
    on: bool
    note: str = ""  # one line when auto turned them on under a cgroup's limit; else ""


def choose_cold_reads(mode: str, host_bytes: int, file_bytes: int,
                      cgroup: CgroupLimit | None) -> ColdReads:
    """``mode`` (COLD_READS_MODES) for a store of ``host_bytes`` over a model file of
    ``file_bytes``, in ``cgroup`` (None: no memory limit)."""
    if mode != "auto":
        return ColdReads(mode == "on")
    if cgroup is None or host_bytes + file_bytes <= cgroup.free:
        return ColdReads(False)
    return ColdReads(True, f"cold reads: on (--cold-reads auto): memory cgroup {cgroup.folder} "
                           f"has {gib(cgroup.free)} free, less than the model file's "
                           f"{gib(file_bytes)} in the page cache beside the "
                           f"{gib(host_bytes)} host budget; experts are read past the "
                           "page cache (--cold-reads off: through it)")


def cold_reads_for(mode: str, host_bytes: int, model_path: str | Path) -> ColdReads:
    """``choose_cold_reads`` for this process's cgroup and the GGUF file (every piece of a split
    set) at ``model_path``; both are read only for auto. A folder has no store to read for."""
    if mode != "auto" or not Path(model_path).is_file():
        return choose_cold_reads(mode, host_bytes, 0, None)
    cgroup = cgroup_limit()
    if cgroup is None:
        return ColdReads(False)
    gf = GGUFFile.open(model_path)
    try:
        file_bytes = gf.total_size
    finally:
        gf.close()
    return choose_cold_reads(mode, host_bytes, file_bytes, cgroup)
