"""What a benchmark report says about where it ran: the machine, the load on it, the versions."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: other work on the machine slows every run."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    cpu = platform.processor()
    cpuinfo, meminfo = Path("/proc/cpuinfo"), Path("/proc/meminfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    ram = None
    if meminfo.exists():
        ram = int(meminfo.read_text().split("MemTotal:")[1].split()[0]) * 1024
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": ram, "os": platform.platform()}


def versions() -> dict:
    from importlib import metadata

    found = {"python": sys.version.split()[0]}
    for name in ("torch", "llama_cpp_python", "moeswap"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent)
        found["moeswap_commit"] = git.stdout.strip() if git.returncode == 0 else None
    except OSError:  # no git: an installed copy
        found["moeswap_commit"] = None
    return found
