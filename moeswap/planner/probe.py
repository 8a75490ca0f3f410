"""``moeswap probe``: measure this machine's rates for the cost model, and cache them.

Measured: cold reads of a scratch file (written, synced, dropped from the page cache with
``posix_fadvise DONTNEED``, then read with ``pread``), a one-token Q8_0 product through the CPU
kernels (bytes of weights per second), and the link: a RAM copy on a CPU-only machine; with
CUDA, a pinned host-to-device copy, and the device tier's own product for ``device_compute``.
For the planner, also the fixed costs those rates miss (``Overheads``): the seconds of one cold
read at each of a ladder of sizes (as the expert store reads an expert piece: ``preadv``, then
``DONTNEED``), and the runtime's seconds per block and per expert served in a decode step,
measured on a small synthetic model (``moeswap.planner.step_costs``).
The result is cached as JSON (default ``$XDG_CACHE_HOME/moeswap/probe.json``, XDG_CACHE_HOME
defaulting to ``~/.cache``) keyed by host name and thread count, and reused until ``refresh`` is
asked for; the overheads are measured and added to an entry by ``cached_overheads``.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeswap.errors import MoeswapError
from moeswap.experts.cost import Rates
from moeswap.experts.settings import OffloadSettings
from moeswap.quant import CpuKernels, quantize_rows

# XDG_CACHE_HOME as the tokenizer cache honours it (the tests point it at a temporary folder).
_CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
DEFAULT_CACHE = _CACHE_HOME / "moeswap" / "probe.json"
_SIZE = 64 << 20  # bytes per measurement: large enough to leave the CPU caches
READ_SIZES = tuple(4096 << 2 * i for i in range(7))  # 4 KiB to 16 MiB, x4 apart
_READS_PER_SIZE = 64  # at most; fewer where they would cover more than the scratch file
OVERHEAD_KEYS = ("read_seconds", "layer_step", "expert_call")


@dataclass(frozen=True)
class Overheads:
    """Fixed costs the bandwidths miss, in seconds."""

    read_seconds: tuple[tuple[int, float], ...]  # (bytes, seconds of one cold read), ascending
    layer_step: float  # one block of a decode step, its bytes apart (torch work, dispatch)
    expert_call: float  # one expert served by the store, its bytes apart (Python, products)


def _best_seconds(action, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - started)
    return best


def measure_disk_read(folder: str | os.PathLike | None = None) -> float:
    """Cold pread bandwidth of a scratch file in ``folder`` (default: the temp folder)."""
    block = np.random.default_rng(0).integers(0, 256, _SIZE, dtype=np.uint8)
    target = np.empty_like(block)
    with tempfile.NamedTemporaryFile(dir=folder) as f:
        f.write(block.tobytes())
        f.flush()
        os.fsync(f.fileno())

        def read():
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, _SIZE, os.POSIX_FADV_DONTNEED)
            view, done = memoryview(target), 0
            while done < _SIZE:
                done += os.preadv(f.fileno(), [view[done:]], done)

        return _SIZE / _best_seconds(read, 3)


def measure_read_seconds(folder: str | os.PathLike | None = None) -> tuple[tuple[int, float], ...]:
    """Seconds of one cold read at each of READ_SIZES, read as ``DiskReader`` reads an expert
    piece: ``preadv`` at a random aligned offset, then ``DONTNEED`` on that range. The mean
    over the reads of a size, the better of two rounds."""
    rng = np.random.default_rng(0)
    target = np.empty(READ_SIZES[-1], dtype=np.uint8)
    with tempfile.NamedTemporaryFile(dir=folder) as f:
        f.write(rng.integers(0, 256, _SIZE, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
        result = []
        for size in READ_SIZES:
            n_reads = min(_READS_PER_SIZE, _SIZE // size)
            read = partial(_cold_reads, f.fileno(), memoryview(target)[:size], n_reads, rng)
            result.append((size, _best_seconds(read, 2) / n_reads))
    return tuple(result)


def _cold_reads(fd: int, view: memoryview, n_reads: int, rng: np.random.Generator) -> None:
    size = len(view)
    cold = hasattr(os, "posix_fadvise")
    if cold:
        os.posix_fadvise(fd, 0, _SIZE, os.POSIX_FADV_DONTNEED)
    for offset in rng.choice(_SIZE // size, n_reads, replace=False) * size:
        done = 0
        while done < size:
            done += os.preadv(fd, [view[done:]], int(offset) + done)
        if cold:
            os.posix_fadvise(fd, int(offset), size, os.POSIX_FADV_DONTNEED)


def _quiet(step: str) -> None:
    """The default ``on_step``: say nothing."""


def measure_overheads(threads: int | None = None, folder: str | os.PathLike | None = None,
                      host_compute: float | None = None, on_step=_quiet) -> Overheads:
    """The read ladder and the runtime's per-block and per-expert step costs (measured on a
    synthetic model: ``moeswap.planner.step_costs``; its bytes at ``host_compute``).
    ``on_step`` is told what is measured next."""
    from moeswap.planner.step_costs import measure_step_costs

    if host_compute is None:
        on_step("CPU products over Q8_0 bytes")
        host_compute = measure_cpu_compute(CpuKernels(threads))
    on_step("decode-step costs on a small model")
    layer_step, expert_call = measure_step_costs(host_compute, threads, folder)
    on_step("cold reads of 4 KiB to 16 MiB")
    return Overheads(measure_read_seconds(folder), layer_step, expert_call)


def measure_ram_copy() -> float:
    source = np.ones(_SIZE, dtype=np.uint8)
    target = np.empty_like(source)
    return _SIZE / _best_seconds(lambda: np.copyto(target, source))


def measure_cpu_compute(kernels: CpuKernels) -> float:
    """Bytes of Q8_0 weights per second in a one-token product (71 MB: beyond the CPU caches)."""
    rows, width = 8192, 8192
    values = np.random.default_rng(0).standard_normal((rows, width), dtype=np.float32)
    raw = quantize_rows(values, GGMLQuantizationType.Q8_0)
    matrix = kernels.matrix(raw, GGMLQuantizationType.Q8_0, (width, rows), "probe")
    x = torch.ones(1, width)
    matrix.matmul(x)  # builds the graph
    return raw.nbytes / _best_seconds(lambda: matrix.matmul(x), 10)


def measure_cuda() -> tuple[float, float]:
    """(pinned host-to-device copy, device product over Q8_0 bytes) in bytes per second."""
    from moeswap.experts.device import _DeviceMatrix

    host = torch.ones(_SIZE, dtype=torch.uint8).pin_memory()
    device = torch.empty(_SIZE, dtype=torch.uint8, device="cuda")

    def copy():
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    rows = width = 8192
    raw = quantize_rows(np.random.default_rng(0).standard_normal((rows, width), dtype=np.float32),
                        GGMLQuantizationType.Q8_0)
    matrix = _DeviceMatrix(torch.from_numpy(raw).reshape(-1).cuda(), GGMLQuantizationType.Q8_0,
                           (width, rows))
    x, ids = torch.ones(1, width), torch.zeros(1, 1, dtype=torch.int32)
    return _SIZE / _best_seconds(copy), raw.nbytes / _best_seconds(lambda: matrix.matmul(x, ids))


def probe(threads: int | None = None, folder: str | os.PathLike | None = None,
          on_step=_quiet) -> Rates:
    """This machine's rates; ``on_step`` is told what is measured next."""
    kernels = CpuKernels(threads)
    on_step("CPU products over Q8_0 bytes")
    compute = measure_cpu_compute(kernels)
    if torch.cuda.is_available():
        on_step("host-to-GPU copies and GPU products")
        link, device_compute = measure_cuda()
    else:
        on_step("RAM copies")
        link, device_compute = measure_ram_copy(), compute
    on_step("cold disk reads")
    return Rates(disk_read=measure_disk_read(folder), link=link, host_compute=compute,
                 device_compute=device_compute)


def _key(threads: int | None) -> str:
    return f"{platform.node()} threads={threads or 'all'}"


def _entries(cache: Path) -> dict[str, dict]:
    """The cache file's entries, checked; {} when there is none."""
    if not cache.exists():
        return {}
    try:
        entries = json.loads(cache.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise _damaged(cache, f"not JSON: {e}") from None
    names = {f.name for f in fields(Rates)}
    if not isinstance(entries, dict):
        raise _damaged(cache, "not a JSON object")
    for key, rates in entries.items():
        if not isinstance(rates, dict) or set(rates) not in (names, names | set(OVERHEAD_KEYS)):
            raise _damaged(cache, f"entry {key!r} does not hold exactly {sorted(names)} "
                                  f"(and perhaps {list(OVERHEAD_KEYS)})")
        if not all(_positive(rates[name]) for name in names):
            raise _damaged(cache, f"entry {key!r} has a rate that is not a positive number")
        if "expert_call" in rates and not (
                _positive(rates["expert_call"]) and _positive(rates["layer_step"])
                and isinstance(rates["read_seconds"], list)
                and rates["read_seconds"]
                and all(isinstance(p, list) and len(p) == 2 and all(map(_positive, p))
                        for p in rates["read_seconds"])):
            raise _damaged(cache, f"entry {key!r} has overheads that are not positive numbers")
    return entries


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _damaged(cache: Path, why: str) -> MoeswapError:
    return MoeswapError(f"{cache}: damaged or stale probe cache ({why}); "
                        "measure again with `moeswap probe --refresh`")


def read_cache(cache: Path = DEFAULT_CACHE) -> dict[tuple[str, str], Rates]:
    """The cached rates by (host name, thread count or "all"); {} without a cache. Never
    measures (``cached_rates`` does)."""
    result = {}
    for key, rates in _entries(cache).items():
        host, _, threads = key.rpartition(" threads=")
        result[host, threads] = Rates(**{f.name: rates[f.name] for f in fields(Rates)})
    return result


def read_overheads(cache: Path = DEFAULT_CACHE) -> dict[tuple[str, str], Overheads]:
    """The cached overheads by (host name, thread count or "all"), where measured. Never
    measures."""
    result = {}
    for key, entry in _entries(cache).items():
        if "expert_call" in entry:
            host, _, threads = key.rpartition(" threads=")
            result[host, threads] = Overheads(
                tuple((int(size), float(seconds)) for size, seconds in entry["read_seconds"]),
                entry["layer_step"], entry["expert_call"])
    return result


def cached_rates(threads: int | None = None, cache: Path = DEFAULT_CACHE,
                 refresh: bool = False, on_step=_quiet) -> Rates:
    """This machine's cached rates; measured (and cached) when there are none. ``refresh``
    measures again, replacing a damaged cache; ``on_step`` is told what is measured."""
    try:
        entries = _entries(cache)
    except MoeswapError:
        if not refresh:
            raise
        entries = {}
    key = _key(threads)
    if refresh or key not in entries:
        entries[key] = asdict(probe(threads, cache.parent if cache.parent.exists() else None,
                                    on_step))
        _write(cache, entries)
    return Rates(**{f.name: entries[key][f.name] for f in fields(Rates)})


def cost_model_rates(settings: OffloadSettings | None, threads: int | None) -> Rates | None:
    """The rates the store's cost model needs under ``settings``: this machine's (cached) when
    a device tier leaves each miss to the model (--miss auto), else None (a CPU-only
    machine's rates, where computing in place always wins, need no probe)."""
    if settings is None or not settings.device_bytes or settings.miss != "auto":
        return None
    return cached_rates(threads)


def cached_overheads(threads: int | None = None, cache: Path = DEFAULT_CACHE,
                     refresh: bool = False, on_step=_quiet) -> Overheads:
    """This machine's cached fixed costs for the planner; measured (and added to the entry,
    whose rates are measured first where absent) when there are none, or with ``refresh``."""
    rates = cached_rates(threads, cache, on_step=on_step)
    entries, key = _entries(cache), _key(threads)
    if refresh or "expert_call" not in entries[key]:
        overheads = measure_overheads(threads, cache.parent, rates.host_compute, on_step)
        entries[key].update(read_seconds=[list(p) for p in overheads.read_seconds],
                            layer_step=overheads.layer_step, expert_call=overheads.expert_call)
        _write(cache, entries)
    return read_overheads(cache)[platform.node(), str(threads or "all")]


def _write(cache: Path, entries: dict) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(entries, indent=1))
