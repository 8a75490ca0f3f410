"""The memory a process's cgroups allow it: the smallest limit on its path, less what is held.

A container (or ``moeswap bench --memory-limit``) caps a process below the machine's RAM with
a memory cgroup, and the kernel reclaims or kills at that cap, not at physical RAM. The
process's cgroup is read from ``/proc/self/cgroup``: cgroup v2 (the ``0::/path`` line, limit
``memory.max``, ``max`` for none) and v1 (the line naming the ``memory`` controller, limit
``memory.limit_in_bytes``, a number near 2**63 for none). Limits are hierarchical, so every
level from the process's own cgroup up to the mount's root is read; at each level what is free
is its limit less the anonymous memory held there (v2 ``memory.stat`` ``anon``, v1
``total_rss``): page cache is reclaimable and not counted. Both paths are parameters, so tests
give a fake filesystem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
UNLIMITED = 1 << 62  # v1 writes "no limit" as 2**63 rounded down to a page


@dataclass(frozen=True)
class CgroupLimit:
    limit: int  # the smallest limit on the path, bytes
    free: int  # at the level that leaves least: its limit less the anonymous memory held there
    folder: Path  # that level's folder


def own_cgroup(root: Path = CGROUP_ROOT,
               self_cgroup: Path = SELF_CGROUP) -> tuple[str, Path, Path] | None:
    """("v1" or "v2", the hierarchy's mount, the folder of this process's memory cgroup)
    -> None without one."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            for mount in (root / "memory", root / controllers):
                if mount.is_dir():
                    return "v1", mount, mount / path.lstrip("/")
    for line in lines:
        if line.startswith("0::") and (root / "cgroup.controllers").exists():
            return "v2", root, root / line[3:].strip().lstrip("/")
    return None


def _limit(version: str, folder: Path) -> int | None:
    name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    try:
        text = (folder / name).read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit() or int(text) >= UNLIMITED:
        return None
    return int(text)


def _anonymous(version: str, folder: Path) -> int:
    key = "anon" if version == "v2" else "total_rss"
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_limit(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> CgroupLimit | None:
    """The tightest memory limit over this process's cgroup and its ancestors -> None when no
    level has one (or there is no cgroup filesystem)."""
    found = own_cgroup(root, self_cgroup)
    if found is None:
        return None
    version, mount, folder = found
    best: CgroupLimit | None = None
    level = folder
    while True:
        limit = _limit(version, level)
        if limit is not None:
            free = max(limit - _anonymous(version, level), 0)
            if best is None or free < best.free:
                best = CgroupLimit(min(limit, best.limit) if best else limit, free, level)
            elif limit < best.limit:
                best = CgroupLimit(limit, best.free, best.folder)
        if level == mount or mount not in level.parents:
            return best
        level = level.parent
