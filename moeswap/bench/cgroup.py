"""A memory cgroup for one benchmark worker: made under this process's own cgroup, removed after.

Both engines then run under the same memory limit, page cache included (the kernel charges a
page read through the cache to the cgroup that read it). cgroup v1: a folder in the memory
hierarchy with ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is
accounted, so the limit is not met by swapping), peak ``memory.max_usage_in_bytes``, failures
``memory.failcnt``. cgroup v2: ``memory.max`` (and ``memory.swap.max`` 0), peak
``memory.peak``, the times the limit was hit ``memory.events`` ``max``. The worker joins the
cgroup before it runs any Python (``enter`` runs in the child between fork and exec). Where no
cgroup can be made (no cgroup filesystem, no memory controller, no permission), ``create``
raises ``NoCgroup`` saying why.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from moeswap.planner.cgroup_memory import CGROUP_ROOT, SELF_CGROUP, own_cgroup


class NoCgroup(Exception):
    """No memory cgroup can be made here; the message says why."""


class MemoryCgroup:
    def __init__(self, version: str, folder: Path):
        self.version, self.folder = version, folder

    @classmethod
    def create(cls, limit: int, name: str, root: Path = CGROUP_ROOT,
               self_cgroup: Path = SELF_CGROUP) -> MemoryCgroup:
        found = own_cgroup(root, self_cgroup)
        if found is None:
            raise NoCgroup(f"no memory cgroup for this process under {root} ({self_cgroup})")
        version, _, parent = found
        folder = parent / name
        try:
            folder.mkdir()
        except OSError as e:
            raise NoCgroup(f"cannot make {folder}: {e.strerror}") from None
        made = cls(version, folder)
        if version == "v2" and not (folder / "memory.max").exists():
            made._enable_memory(parent)
        try:
            if version == "v2":
                made._write("memory.max", limit)
                made._write("memory.swap.max", 0, optional=True)
            else:
                made._write("memory.limit_in_bytes", limit)
                made._write("memory.memsw.limit_in_bytes", limit, optional=True)
        except OSError as e:
            made.remove()
            raise NoCgroup(f"cannot limit {folder}: {e.strerror}") from None
        return made

    @staticmethod
    def _enable_memory(parent: Path) -> None:
        """v2 gives a child memory files only when its parent delegates the controller; the
        kernel refuses while the parent holds processes itself (then ``create`` says so)."""
        try:
            (parent / "cgroup.subtree_control").write_text("+memory")
        except OSError:
            pass

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        path = self.folder / name
        if optional and not path.exists():
            return
        try:
            path.write_text(str(value))
        except OSError:
            if not optional:
                raise

    def enter(self) -> None:
        """Move the calling process into the cgroup (a worker's preexec_fn)."""
        (self.folder / "cgroup.procs").write_text(str(os.getpid()))

    def figures(self) -> dict:
        """{cgroup_peak_bytes, cgroup_failcnt, cgroup_oom_kills}; None where the kernel does not
        keep one."""
        if self.version == "v2":
            events = self._fields("memory.events")
            return {"cgroup_peak_bytes": self._number("memory.peak"),
                    "cgroup_failcnt": events.get("max"), "cgroup_oom_kills": events.get("oom_kill")}
        return {"cgroup_peak_bytes": self._number("memory.max_usage_in_bytes"),
                "cgroup_failcnt": self._number("memory.failcnt"),
                "cgroup_oom_kills": self._fields("memory.oom_control").get("oom_kill")}

    def _number(self, name: str) -> int | None:
        try:
            return int((self.folder / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _fields(self, name: str) -> dict[str, int]:
        try:
            lines = (self.folder / name).read_text().splitlines()
        except OSError:
            return {}
        return {k: int(v) for k, _, v in (line.partition(" ") for line in lines) if v.isdigit()}

    def remove(self, tries: int = 50) -> None:
        """Remove the folder; a worker just reaped may take a moment to leave it."""
        for _ in range(tries):
            try:
                self.folder.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                pass
            for f in self.folder.iterdir():  # a fake tree's plain files; cgroupfs refuses
                try:
                    f.unlink()
                except OSError:
                    pass
            time.sleep(0.1)
