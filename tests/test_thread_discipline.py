"""Decode steps run torch at one thread while ggml's graphs keep every thread; prefill keeps
torch's threads (moeswap/quant/threads.py)."""

from __future__ import annotations

from pathlib import Path

import torch

import moeswap
from moeswap.quant.threads import DECODE_TOKENS

BUILTIN = Path(moeswap.__file__).parent / "data" / "stdlib-moe-q8_0.gguf"


def test_decode_steps_run_torch_at_one_thread_and_prefill_at_all():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = moeswap.load(BUILTIN).model
        model.token_graph = None  # torch runs in the layer loop; a token graph's step has none
        seen = []
        first = model.layers[0]
        model.layers[0] = lambda x, batch: (seen.append(torch.get_num_threads()), first(x, batch))[1]
        cache = model.new_cache()
        model.forward([torch.arange(DECODE_TOKENS + 1)], [cache])  # a prompt chunk
        model.forward([torch.tensor([5])], [cache])  # a decode step
        model.forward([torch.tensor([6]), torch.tensor([7])], [cache, model.new_cache()])
        assert seen == [2, 1, 1]
        assert torch.get_num_threads() == 2  # given back after each step
    finally:
        torch.set_num_threads(before)
