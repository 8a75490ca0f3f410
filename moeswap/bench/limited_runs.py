"""What a worker runs inside a memory cgroup (``moeswap bench --memory-limit``): one prompt,
then greedy decode steps, each engine as a user would run it under that limit.

moeswap plans its budgets from inside the cgroup (`--plan auto`'s path: the cgroup's room,
moeswap.planner.auto) and reads experts past the page cache (``cold_reads``); llama.cpp maps the
file (its page cache is charged to the cgroup), with ``mlock`` where asked. Both report the
bytes the process read from storage while decoding (``/proc/self/io`` ``read_bytes``, which
counts mapped pages faulted in as well as ``O_DIRECT`` reads), and moeswap its store's counts.
"""

from __future__ import annotations

import time
from pathlib import Path

_IO = Path("/proc/self/io")


def storage_read_bytes() -> int | None:
    """Bytes this process has read from storage (not from the page cache); None without /proc."""
    try:
        for line in _IO.read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _timed(session, prompt: list[int], gen_tokens: int, counters) -> dict:
    """Prefill ``prompt`` then ``gen_tokens`` decode steps -> speeds and the counters' change
    over the decode steps."""
    session.reset()
    began = time.perf_counter()
    token = session.feed(prompt)
    prompt_s = time.perf_counter() - began
    before, read_before = counters(), storage_read_bytes()
    began = time.perf_counter()
    for _ in range(gen_tokens):
        token = session.feed([token])
    decode_s = time.perf_counter() - began
    after, read_after = counters(), storage_read_bytes()
    return {"prompt_tok_s": len(prompt) / prompt_s, "decode_tok_s": gen_tokens / decode_s,
            "decode_tokens": gen_tokens,
            "read_bytes_per_token": None if read_before is None
            else (read_after - read_before) / gen_tokens,
            "counts": {k: after[k] - before[k] for k in after if k != "hit_rate"}}


def moeswap_run(model: str, threads: int, prompt: list[int], gen_tokens: int,
                replay_routing: str | None = None, prefetch: str = "off",
                kv_type: str = "f16") -> dict:
    """moeswap under the cgroup this worker is in: budgets from `--plan auto`'s planner."""
    from moeswap import runtime as engine
    from moeswap.bench.moeswap_runner import MoeswapSession
    from moeswap.experts.build import load_options
    from moeswap.experts.settings import OffloadSettings
    from moeswap.memory import HostCharge
    from moeswap.planner.auto import auto_plan, machine_memory
    from moeswap.planner.rates import plan_rates

    context = len(prompt) + gen_tokens + 1
    auto = auto_plan(model, context, machine_memory(), plan_rates({}), step_tokens=len(prompt),
                     kv_type=kv_type)
    settings = None if auto.host_bytes is None else OffloadSettings(
        host_bytes=auto.host_bytes, cold_reads=True, prefetch=prefetch)
    charge = HostCharge.for_sequence(context, len(prompt), kv_type=kv_type)
    runtime = engine.load(model, threads=threads, replay_routing=replay_routing,
                          **load_options(settings, charge))
    stats = runtime.stats if settings is not None else dict

    def counters() -> dict:
        now = stats()
        disk, prefetch = now.get("disk", {}), now.get("prefetch", {})
        return {**now.get("total", {}),
                **({"disk_busy_seconds": disk["busy_seconds"], "disk_read_bytes": disk["bytes"]}
                   if disk else {}),
                **({"guess_wasted_bytes": prefetch["bytes_wasted"],
                    "prefetch_forwards_on": prefetch["adaptive"]["forwards_on"],
                    "prefetch_forwards_off": prefetch["adaptive"]["forwards_off"]}
                   if prefetch else {})}

    run = _timed(MoeswapSession(runtime.model, len(prompt)), prompt, gen_tokens, counters)
    return {**run, "host_bytes": auto.host_bytes, "plan": auto.describe()}


def llama_run(model: str, threads: int, prompt: list[int], gen_tokens: int,
              mlock: bool = False, kv_type: str = "f16") -> dict:
    """llama.cpp (llama-cpp-python) with the file mapped, locked in RAM with ``mlock``."""
    import llama_cpp

    from moeswap.bench.llama_cpp_runner import LlamaSession, kv_arguments

    llm = llama_cpp.Llama(model, n_ctx=len(prompt) + gen_tokens + 1, n_batch=len(prompt),
                          n_ubatch=len(prompt), n_threads=threads, n_threads_batch=threads,
                          use_mmap=True, use_mlock=mlock, verbose=False,
                          **kv_arguments(kv_type))
    return _timed(LlamaSession(llm), prompt, gen_tokens, dict)
