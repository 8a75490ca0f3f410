"""A run of llama.cpp (llama-cpp-python) inside a worker: the same GGUF, threads, context and
prompt pieces as moeswap's run. It takes no RAM budget: its weights are either mapped from the
file (the page cache decides what stays) or read whole into RAM (``use_mmap=False``)."""

from __future__ import annotations

import time

import numpy as np
from gguf import GGMLQuantizationType

from moeswap.bench.memory import MemoryTrace
from moeswap.bench.scenarios import RunSpec
from moeswap.bench.timing import run_sequential, warm_up

def kv_arguments(kv_type: str) -> dict:
    """llama_cpp.Llama's cache type for ``kv_type``; a Q8_0 V cache needs flash attention
    (llama.cpp refuses it without), which moeswap's q8_0 cache mirrors."""
    kind = int(GGMLQuantizationType[kv_type.upper()])  # llama.cpp's type_k / type_v
    return {"type_k": kind, "type_v": kind, "flash_attn": kv_type == "q8_0"}


class LlamaSession:
    def __init__(self, llm):
        self.llm = llm

    def reset(self) -> None:
        self.llm.reset()  # the next eval drops the cache past position 0

    def feed(self, ids: list[int]) -> int:
        self.llm.eval(ids)
        # without logits_all only the last position's row exists
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))


def run(spec: RunSpec) -> dict:
    import llama_cpp

    memory = MemoryTrace()
    memory.sample("start")
    began = time.perf_counter()
    llm = llama_cpp.Llama(spec.model, n_ctx=spec.n_ctx, n_batch=spec.prefill_chunk,
                          n_ubatch=spec.prefill_chunk, n_threads=spec.threads,
                          n_threads_batch=spec.threads, use_mmap=spec.llama_mmap, verbose=False,
                          **kv_arguments(spec.kv_type))
    load_s = time.perf_counter() - began
    memory.sample("load")
    session = LlamaSession(llm)
    warm_up(session, spec)
    memory.sample("warm-up")
    timing = run_sequential(session, spec, memory)
    return {"load_s": load_s, **timing, "hit_rate": None, "bytes_moved": None, "store": None,
            **memory.peaks(), "memory_trace": memory.samples}
