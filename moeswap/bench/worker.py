"""Each run in its own process, so engines share no threads, caches or peak-memory figures,
and a run that fails -- an error, out of memory, a crash, a timeout -- is recorded as such
while the benchmark goes on. Every run starts with the model file in the page cache.

    python -m moeswap.bench.worker SPEC.json RESULT.json     (what ``run_isolated`` starts)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from moeswap.bench.scenarios import RunSpec


def run_isolated(spec: RunSpec, folder: Path, name: str, timeout_s: float | None) -> dict:
    """Run ``spec`` in a worker -> its figures with status "ok", or status "failed" with
    ``failure`` (error, oom, crash, timeout) and ``error`` (what it said)."""
    spec_path, result_path = folder / f"{name}.spec.json", folder / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec.__dict__))
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "moeswap.bench.worker", str(spec_path), str(result_path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
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


def main(spec_path: str, result_path: str) -> None:
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    if spec.engine == "moeswap":
        from moeswap.bench.moeswap_runner import run
    else:
        from moeswap.bench.llama_cpp_runner import run
    try:
        warm_s = warm_page_cache(spec.model)
        result = {"status": "ok", "page_cache_warm_s": warm_s, **run(spec)}
    except MemoryError as e:
        result = failed("oom", f"MemoryError: {e}")
    except Exception as e:  # any failure is the run's result, written for the parent
        traceback.print_exc()
        result = failed("error", f"{type(e).__name__}: {e}")
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
