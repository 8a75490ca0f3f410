"""A run of moeswap inside a worker: load with the run's offload flags, time the scenario,
read the expert store's counters. The store is charged and prompts are prefilled as the command
the run stands for does (moeswap.bench.scenarios.store_charge): ``prefill_chunk`` tokens per
forward, `moeswap run`'s ``prefill`` for prompts one after another, the server's scheduler for
a batch."""

from __future__ import annotations

import time

import torch

from moeswap.bench.memory import MemoryTrace
from moeswap.bench.scenarios import RunSpec, batch_options, store_charge
from moeswap.bench.timing import figures, run_sequential, warm_up
from moeswap.errors import MoeswapError
from moeswap.generate import prefill


class MoeswapSession:
    def __init__(self, model, step_tokens: int):
        self.model, self.step_tokens = model, step_tokens
        self.cache = None

    def reset(self) -> None:
        # As llama.cpp's reset: the cache forgets its positions and keeps its buffers (and the
        # layer graphs bound to them); a new one where a ring can no longer be cut back to 0.
        if self.cache is not None and self.cache.can_truncate(0):
            self.cache.truncate(0)
        else:
            self.cache = self.model.new_cache()

    def feed(self, ids: list[int]) -> int:
        logits = prefill(self.model, [ids], [self.cache], self.step_tokens)[0]  # [V]
        return int(torch.argmax(logits))


def run(spec: RunSpec) -> dict:
    from moeswap import runtime as engine
    from moeswap.experts.build import load_options
    from moeswap.planner.auto import fits_in_ram
    from moeswap.planner.probe import cost_model_rates

    memory = MemoryTrace()
    memory.sample("start")
    store = load_options(spec.offload, store_charge(spec),
                         cost_model_rates(spec.offload, spec.threads))
    began = time.perf_counter()
    runtime = engine.load(spec.model, threads=spec.threads, replay_routing=spec.replay_routing,
                          repack=True, in_ram=spec.offload is None and fits_in_ram(spec.model, store_charge(spec)),
                          **store)  # as moeswap run
    load_s = time.perf_counter() - began
    if store:
        memory.stats = runtime.stats
    memory.sample("load")
    session = MoeswapSession(runtime.model, spec.prefill_chunk)
    warm_up(session, spec)
    memory.sample("warm-up")
    before = runtime.stats()
    if spec.batched:
        timing = run_batched(runtime.model, spec, memory)
    else:
        timing = run_sequential(session, spec, memory)
    return {"load_s": load_s, **timing, **store_figures(before, runtime.stats()),
            **memory.peaks(), "memory_trace": memory.samples}


def store_figures(before: dict, after: dict) -> dict:
    """Hit rate and bytes moved during the timed part (the store's counters, less those of
    load and warm-up)."""
    if "total" not in after:  # no store (replayed routing alone reports only itself)
        return {"hit_rate": None, "bytes_moved": None, "store": None}
    was, now = before["total"], after["total"]
    moved = {k: now[k] - was[k] for k in now if k != "hit_rate"}
    hits = moved["device_hits"] + moved["host_hits"]
    return {"hit_rate": hits / moved["requests"] if moved["requests"] else None,
            "bytes_moved": moved["disk_bytes"] + moved["transfer_bytes"], "store": moved}


def run_batched(model, spec: RunSpec, memory: MemoryTrace) -> dict:
    """All prompts submitted at once to the server's scheduler (moeswap.server.batching); one
    memory sample per batch step. Prompt time: until every request has its first token;
    decode time: from then to the last token."""
    from moeswap.sampling import GREEDY, Sampler
    from moeswap.server.batching import BatchScheduler

    n = len(spec.prompts)
    scheduler = BatchScheduler(model, batch_options(spec))
    arrivals: list[list[float]] = [[] for _ in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]
    errors: list[str] = []
    sampled_step = [-1]

    def listener(i: int):
        def on_event(event) -> None:  # called between steps
            if event.token is not None:
                arrivals[i].append(time.perf_counter())
                outputs[i].append(event.token)
                if scheduler.counters.steps != sampled_step[0]:
                    sampled_step[0] = scheduler.counters.steps
                    memory.sample("batch step")
                return
            if event.error:
                errors.append(event.error)
        return on_event

    scheduler.start(here=True)  # steps on this thread, which loaded the model (drain's why)
    try:
        start = time.perf_counter()
        for i, prompt in enumerate(spec.prompts):
            scheduler.submit(prompt, max_tokens=spec.gen_tokens, sampler=Sampler(GREEDY),
                             stop_ids=frozenset(), on_event=listener(i))
        scheduler.drain()
        end = time.perf_counter()
    finally:
        scheduler.stop()
    if errors:
        raise MoeswapError(errors[0])
    prefill_end = max(times[0] for times in arrivals)
    return figures(prompt_tokens=sum(map(len, spec.prompts)), prompt_s=prefill_end - start,
                   decode_tokens=sum(t > prefill_end for times in arrivals for t in times),
                   decode_s=end - prefill_end, first_tokens=[t[0] - start for t in arrivals],
                   wall_s=end - start, outputs=outputs)
