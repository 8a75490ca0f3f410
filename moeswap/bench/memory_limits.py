"""``moeswap bench --memory-limit SIZE[,SIZE...]``: moeswap and llama.cpp under the same memory
limit, each worker in a memory cgroup of that size (moeswap.bench.cgroup), beside the floor.

Per limit and engine: the model file is dropped from the page cache, a cgroup made under the
benchmark's own, the worker (moeswap.bench.limited_runs) run in it, its peak and failure counts
read, the cgroup removed. moeswap plans its budgets from the limit (`--plan auto`'s planner
sees the cgroup) and reads cold; llama.cpp maps the file, and also runs with ``--mlock`` where
the file fits in the limit. A limit no cgroup can be made for is said so and its rows skipped.

The floor of a decode token, with reads overlapped with compute: max(bytes the token needed
from storage / the cold-read rate, bytes computed / the rate CPU products stream stored
weights). Bytes needed are the run's own reads (``/proc/self/io``) less what prefetch read for
guesses nobody used (a wrong guess is time lost, not part of the floor); bytes computed are
what one token's products read:
every shared weight but a token-embedding table that is not also the output head, and top-k
routed experts per MoE layer (the KV cache, small at these contexts, is left out).

The cold-read rate is `moeswap probe`'s measurement (a scratch file written, dropped from the
page cache, read), taken beside each run: before it and after it, in the model's folder, and
the faster of the two is that row's rate (the stricter floor); where moeswap's own reads ran
faster while the disk was busy with them, that rate is the floor's (the disk allowed it). A
virtual disk's rate moves by a quarter within minutes (docs/BENCHMARKS.md), so a rate cached
hours earlier says little of the disk a run had; the row against the cached probe's rate is
reported too. The product rate is the cached probe's (else the planner's conservative
defaults, named in the report).
moeswap's rows also carry the run's own measure of overlap, which needs no rate: the share of
decode time during which any expert read ran ("disk busy", from the store's reader), and the
rate it read at meanwhile.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from moeswap.bench.cgroup import MemoryCgroup, NoCgroup
from moeswap.bench.scenarios import ModelFacts
from moeswap.bench.worker import run_call
from moeswap.planner.cgroup_memory import CGROUP_ROOT, SELF_CGROUP

RUNS = "moeswap.bench.limited_runs"


def computed_bytes_per_token(path: str) -> int:
    from moeswap.experts.store import routed_bytes
    from moeswap.formats.gguf_file import GGUFFile

    facts, gguf = ModelFacts.of(path), GGUFFile.open(path)
    embedding = gguf.tensor("token_embd.weight")
    untied = embedding is not None and gguf.tensor("output.weight") is not None
    expert = routed_bytes(gguf, facts.config.moe_layers) // (facts.moe_layers * facts.n_expert)
    return (facts.shared_bytes - (embedding.n_bytes if untied else 0)
            + facts.n_used * facts.moe_layers * expert)


def drop_from_page_cache(path: str) -> None:
    """Evict the file's pages so no run starts with what an earlier one read."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def engines(facts: ModelFacts, limit: int, compare: bool, replay: str | None,
            prefetch: str) -> list[tuple[str, str, dict]]:
    """(label, worker function, its keyword arguments) of each run at ``limit``."""
    runs = [("moeswap" + (", replayed routing" if replay else ""), "moeswap_run",
             {"replay_routing": replay, "prefetch": prefetch})]
    if compare:
        runs.append(("llama.cpp mmap", "llama_run", {"mlock": False}))
        if facts.file_bytes < limit:
            runs.append(("llama.cpp mmap + mlock", "llama_run", {"mlock": True}))
    return runs


def floor_row(result: dict, computed: int, rates) -> dict:
    """Per decode token: seconds of the floor, the run's seconds, and their ratio; where the
    store reports its reads, the share of decode time the disk was busy and the rate it read
    at meanwhile (the run's own measure of overlap, free of the probe's rate), which is the
    floor's read rate where it beats the probe's (the disk allowed it)."""
    counts = result.get("counts") or {}
    wasted = counts.get("guess_wasted_bytes", 0) / result.get("decode_tokens", 1)
    read = max(0.0, (result.get("read_bytes_per_token") or 0) - wasted)  # needed
    measured_s = 1 / result["decode_tok_s"]
    row, read_rate = {}, rates.disk_read
    busy = counts.get("disk_busy_seconds")
    if busy:
        row["disk_busy"] = busy / (result["decode_tokens"] * measured_s)
        row["busy_read_rate"] = counts["disk_read_bytes"] / busy  # guesses' reads too
        read_rate = max(read_rate, row["busy_read_rate"])
    floor_s = max(read / read_rate, computed / rates.host_compute)
    return {"floor_tok_s": 1 / floor_s, "of_floor": floor_s / measured_s,
            "floor_read_rate": read_rate, **row}


def run_limits(model: str, limits: list[int], threads: int, prompt: list[int], gen_tokens: int,
               compare: bool, replay: str | None, prefetch: str, out: Path,
               timeout_s: float, say=print, cgroup_root: Path = CGROUP_ROOT,
               self_cgroup: Path = SELF_CGROUP, kv_type: str = "f16",
               disk_rate: Callable[[], float] | None = None) -> tuple[dict, str]:
    """Every engine at every limit, both with a ``kv_type`` cache -> (the report's body, its
    markdown table); the cgroup filesystem's paths and ``disk_rate`` (bytes per second of cold
    reads now; default: the probe's measurement in the model's folder) are parameters for
    tests."""
    from moeswap.planner.rates import plan_rates

    planned = plan_rates({})
    facts, rates = ModelFacts.of(model), planned.rates
    computed = computed_bytes_per_token(model)
    disk_rate = disk_rate or (lambda: _cold_read_rate(model))
    rows, notes = [], []
    rate_before = None
    for limit in limits:
        for label, function, extra in engines(facts, limit, compare, replay, prefetch):
            name = f"{label} at {limit >> 20} MiB"
            try:
                cgroup = MemoryCgroup.create(limit, f"moeswap-bench-{os.getpid()}", cgroup_root,
                                             self_cgroup)
            except NoCgroup as e:
                notes.append(f"{limit >> 20} MiB: no memory cgroup can be made here ({e}); "
                             "its rows are skipped")
                break
            say(f"{name} ...")
            if rate_before is None:
                rate_before = disk_rate()
            drop_from_page_cache(model)
            try:
                kwargs = {"model": model, "threads": threads, "prompt": prompt,
                          "gen_tokens": gen_tokens, "kv_type": kv_type, **extra}
                result = run_call(f"{RUNS}:{function}", kwargs, out, name.replace(" ", "_"),
                                  timeout_s, cgroup=cgroup)
                result.update(cgroup.figures())
            finally:
                cgroup.remove()
            rate_after = disk_rate()
            beside = max(rate_before, rate_after)
            row = {"limit_bytes": limit, "engine": label, **result,
                   "disk_read_beside": [rate_before, rate_after]}
            rate_before = rate_after
            if result["status"] == "ok":
                row.update(floor_row(result, computed,
                                     dataclasses.replace(rates, disk_read=beside)))
                row["of_floor_cached_probe"] = floor_row(result, computed, rates)["of_floor"]
            rows.append(row)
    body = {"model": model, "model_bytes": facts.file_bytes, "computed_bytes_per_token": computed,
            "rates": {"disk_read": rates.disk_read, "host_compute": rates.host_compute,
                      "source": planned.source}, "rows": rows, "notes": notes}
    return body, table(body)


def _cold_read_rate(model: str) -> float:
    """The probe's cold reads on the model's filesystem (the temp folder where its folder is
    read-only)."""
    from moeswap.planner.probe import measure_disk_read

    try:
        return measure_disk_read(Path(model).resolve().parent)
    except OSError:
        return measure_disk_read()


def table(body: dict) -> str:
    r = body["rates"]
    lines = [(f"Model {body['model']} ({body['model_bytes'] / 2**20:.0f} MiB); floor from cold "
              "reads measured beside each run (the faster of before and after, column 'cold "
              "reads', or moeswap's own reads while busy where faster) and products over "
              f"stored weights {r['host_compute'] / 1e9:.1f} GB/s "
              f"({r['source']}); 'of cached floor': against that probe's cold reads, "
              f"{r['disk_read'] / 1e9:.2f} GB/s; computed per token "
              f"{body['computed_bytes_per_token'] / 2**20:.0f} MiB."), "",
             ("| limit MiB | engine | decode tok/s | prompt tok/s | hit rate | misses/token | "
              "MiB read/token (guessed in vain) | cgroup peak MiB | failcnt | cold reads GB/s | "
              "floor tok/s | of floor | of cached floor | disk busy | GB/s while busy | "
              "prefetch on |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in body["rows"]:
        head = f"| {row['limit_bytes'] >> 20} | {row['engine']} |"
        if row["status"] != "ok":
            lines.append(f"{head} {row['failure']}: {row['error']} ||||||||||||||")
            continue
        counts = row.get("counts") or {}
        requests = counts.get("requests")
        hits = (counts.get("host_hits", 0) + counts.get("device_hits", 0)) if requests else None
        misses = counts.get("disk_misses")
        read = row.get("read_bytes_per_token")
        wasted = counts.get("guess_wasted_bytes", 0) / row["decode_tokens"]
        lines.append(
            f"{head} {row['decode_tok_s']:.2f} | {row['prompt_tok_s']:.2f} | "
            + (f"{hits / requests:.1%} | {misses / row['decode_tokens']:.1f} | " if requests
               else "- | - | ")
            + ("- | " if read is None else f"{read / 2**20:.0f}"
               + (f" ({wasted / 2**20:.0f})" if wasted else "") + " | ")
            + f"{_mib(row.get('cgroup_peak_bytes'))} | {row.get('cgroup_failcnt', '-')} | "
            f"{max(row['disk_read_beside']) / 1e9:.2f} | "
            f"{row['floor_tok_s']:.2f} | {row['of_floor']:.0%} | "
            f"{row['of_floor_cached_probe']:.0%} | "
            + (f"{row['disk_busy']:.0%} | {row['busy_read_rate'] / 1e9:.2f} |"
               if "disk_busy" in row else "- | - |")
            + f" {_forwards_on(counts)} |")
    return "\n".join(lines + [""] + [f"Note: {n}" for n in body["notes"]])


def _forwards_on(counts: dict) -> str:
    """The share of forwards the prefetch throttle ran prefetch in; - without prefetch."""
    if "prefetch_forwards_on" not in counts:
        return "-"
    on, off = counts["prefetch_forwards_on"], counts["prefetch_forwards_off"]
    return f"{on / (on + off):.0%}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"
