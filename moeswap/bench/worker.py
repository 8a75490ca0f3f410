"""Each run in its own process, so engines share no threads, caches or peak-memory figures,
and a run that fails -- an error, out of memory, a crash, a timeout -- is recorded as such
while the benchmark goes on. A scenario's run starts with the model file in the page cache; a suite's measurement
(``run_call``: a function of moeswap.bench.suites and its keyword arguments, both in JSON)
does what its function says.

    python -m moeswap.bench.worker JOB.json RESULT.json     (what ``run_isolated`` starts)
"""

from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from moeswap.bench.scenarios import RunSpec


def run_isolated(spec: RunSpec, folder: Path, name: str, timeout_s: float | None) -> dict:
    """Run ``spec`` in a worker -> its figures with status "ok", or status "failed" with
    ``failure`` (error, oom, crash, timeout) and ``error`` (what it said)."""
    return run_job({"run": asdict(spec)}, folder, name, timeout_s)


def run_call(function: str, kwargs: dict, folder: Path, name: str,
             timeout_s: float | None = None, cgroup=None) -> dict:
    """``function`` ("module:name") called with ``kwargs`` in a worker -> its dict with status
    "ok", or a failure as ``run_isolated`` records it; ``cgroup``: a
    moeswap.bench.cgroup.MemoryCgroup the worker joins before it starts."""
    return run_job({"call": function, "kwargs": kwargs}, folder, name, timeout_s, cgroup)


def run_job(job: dict, folder: Path, name: str, timeout_s: float | None, cgroup=None) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = folder / f"{name}.spec.json", folder / f"{name}.result.json"
    spec_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "moeswap.bench.worker", str(spec_path), str(result_path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=None if cgroup is None else cgroup.enter)
    except subprocess.TimeoutExpired:
        return failed("timeout", f"still running after {timeout_s:.0f} s; stopped")
    if result_path.exists():
        return json.loads(result_path.read_text())
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    if done.returncode == -signal.SIGKILL:  # what the kernel's OOM killer sends
        return failed("oom", f"killed by SIGKILL (out of memory?); last words: {last}")
    return failed("crash", f"exit status {done.returncode}: {last}")


def failed(kind: str, message: str) -> dict:
    return {"status": "failed", "failure": kind, "error": message}


def warm_page_cache(path: str, piece: int = 16 << 20) -> float:
    """Read the whole file once, untimed, so every run starts with it in the page cache (a
    previous run's --cold-reads may have dropped parts of it) -> seconds taken."""
    began = time.perf_counter()
    buffer = bytearray(piece)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - began


def run_spec(fields: dict) -> dict:
    from moeswap.experts.settings import OffloadSettings

    offload = fields["offload"] and OffloadSettings(**fields["offload"])
    spec = RunSpec(**{**fields, "offload": offload})
    if spec.engine == "moeswap":
        from moeswap.bench.moeswap_runner import run
    else:
        from moeswap.bench.llama_cpp_runner import run
    warm_s = warm_page_cache(spec.model) if spec.warm_page_cache else None
    return {"page_cache_warm_s": warm_s, **run(spec)}


def call(function: str, kwargs: dict) -> dict:
    module, name = function.split(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    try:
        found = call(job["call"], job["kwargs"]) if "call" in job else run_spec(job["run"])
        result = {"status": "ok", **found}
    except MemoryError as e:
        result = failed("oom", f"MemoryError: {e}")
    except Exception as e:  # any failure is the run's result, written for the parent
        traceback.print_exc()
        result = failed("error", f"{type(e).__name__}: {e}")
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
