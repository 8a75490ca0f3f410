"""The host slots reserved for prefetch guesses cost nothing while the throttle has prefetch off:
they keep the LRU policy's latest victims, so the store reads exactly what a prefetch-off store
with the same budget reads, step by step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tiny_models
from moeswap.experts.store import ExpertStore, StoreOptions
from moeswap.formats.gguf_file import GGUFFile
from moeswap.gguf_tools.convert import convert
from moeswap.models.quant_experts import QuantResidentExperts
from moeswap.quant import CpuKernels
from test_expert_store import plan


@pytest.fixture(scope="module")
def wide_mixtral(tmp_path_factory):
    """Three MoE layers of sixteen experts: enough host slots for a reserve (one in eight)."""
    folder = tmp_path_factory.mktemp("reserve")
    tiny_models.save("mixtral", folder / "hf", num_local_experts=16, num_hidden_layers=3)
    return convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")


def _reads(store) -> list[int]:
    return [s.disk_misses for s in store.layer_stats.values()]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_throttled_off_the_reserve_reads_what_prefetch_off_reads(wide_mixtral, data):
    gguf = GGUFFile.open(wide_mixtral)
    fixed, slot, layers, n_experts = plan(wide_mixtral)
    slots = data.draw(st.integers(8, len(layers) * n_experts), label="host slots")
    depth = data.draw(st.integers(1, 4), label="depth")
    options = StoreOptions(host_bytes=fixed + slots * slot, policy="lru", prefetch="history",
                           prefetch_depth=depth)
    kernels = CpuKernels(1)
    reserve = ExpertStore(gguf, kernels, layers, "silu", options)
    reserve.prefetch.throttle.forward = lambda n_tokens: False
    assert reserve.guess_slots == min(2 * depth, slots // 8) > 0
    off = ExpertStore(gguf, kernels, layers, "silu", StoreOptions(
        host_bytes=fixed + slots * slot, policy="lru", prefetch="off"))
    resident = QuantResidentExperts(gguf, kernels, layers, "silu")
    hot = data.draw(st.integers(2, n_experts), label="experts in use")  # skew: reuse happens
    for _ in range(data.draw(st.integers(1, 12), label="tokens")):
        for layer in layers:
            experts = data.draw(st.lists(st.integers(0, hot - 1), min_size=2, max_size=2,
                                         unique=True))
            x, weights = torch.randn(1, 64), torch.rand(1, 2)
            ids = torch.tensor([experts])
            expected = resident.run(layer, x, ids, weights)
            assert torch.equal(reserve.run(layer, x, ids, weights), expected)
            assert torch.equal(off.run(layer, x, ids, weights), expected)
            assert _reads(reserve) == _reads(off)
            held = set(reserve.slots["host"]) | set(reserve.guesses.slots)
            assert held == set(off.slots["host"])
    assert reserve.prefetch.counts.reads == 0
    reserve.close()
