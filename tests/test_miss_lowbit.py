"""--miss-lowbit: off by default and then exact; when on, a fired expert is computed from its
low-bit copy (checked against a naive float64 reference), counted exactly, inside the budget.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings, strategies as st
from test_expert_store import decode_logits

from moeswap.errors import MoeswapError
from moeswap.experts.lowbit import LowBitCopies
from moeswap.memory import forward_working_bytes, kv_bytes_per_token
from moeswap.experts.store import ExpertStore, shared_bytes
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.tiers import piece_offsets, slot_bytes
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models import load_model
from moeswap.models.quant_experts import ExpertLayout, QuantResidentExperts
from moeswap.quant import CpuKernels, quantize_rows
from moeswap.quant.reference import dequantize_matrix


def plan(path) -> tuple[GGUFFile, int, int, list[int], int]:
    """(file, fixed host bytes: shared weights and staging, slot bytes, MoE layers, experts)."""
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    layouts = [ExpertLayout.from_file(gguf, i) for i in config.moe_layers]
    slot = slot_bytes(layouts)
    fixed = shared_bytes(gguf, config.moe_layers) + config.n_expert_used * slot
    return gguf, fixed, slot, config.moe_layers, layouts[0].n_experts


def copies_bytes(path, type_name: str = "q4_0") -> int:
    gguf, _, _, layers, _ = plan(path)
    return LowBitCopies(gguf, {i: ExpertLayout.from_file(gguf, i) for i in layers},
                        type_name).nbytes


def direct_store(path, host_slots: int, **options) -> ExpertStore:
    gguf, fixed, slot, layers, _ = plan(path)
    copies = copies_bytes(path, options["miss_lowbit"]) if options.get("miss_lowbit") else 0
    return ExpertStore(gguf, CpuKernels(1), layers, "silu",
                       OffloadSettings(host_bytes=fixed + copies + host_slots * slot, **options))


def test_off_by_default_and_then_bitwise_the_resident_models(mixtral_q8):
    assert OffloadSettings(host_bytes=0).miss_lowbit == ""
    expected = decode_logits(load_model(mixtral_q8, threads=1, expert_runner=QuantResidentExperts))
    _, fixed, slot, layers, n_experts = plan(mixtral_q8)
    factory = build_store(OffloadSettings(host_bytes=fixed + len(layers) * slot))
    assert torch.equal(decode_logits(load_model(mixtral_q8, threads=1, expert_runner=factory)),
                       expected)
    assert "lowbit" not in factory.stats()
    # On, with room for every expert: every miss is admitted and read in full, none fires.
    everything = fixed + copies_bytes(mixtral_q8) + len(layers) * n_experts * slot
    factory = build_store(OffloadSettings(host_bytes=everything, miss_lowbit="q4_0"))
    assert torch.equal(decode_logits(load_model(mixtral_q8, threads=1, expert_runner=factory)),
                       expected)
    assert factory.stats()["lowbit"]["fires"] == 0


def naive_layer(matrices: dict[str, np.ndarray], x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """float64 SwiGLU experts from dequantized matrices [X, out, in]: x [T, D] -> [T, D]."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e, row = int(ids[t, k]), x[t].double()
            gate, up, down = (torch.from_numpy(matrices[kind][e]) for kind in ("gate", "up", "down"))
            h = torch.nn.functional.silu(gate @ row) * (up @ row)
            out[t] += float(weights[t, k]) * (down @ h)
    return out


def nmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b) ** 2).sum() / (b ** 2).sum())


def test_prefetch_stays_off_with_low_bit_copies(mixtral_q8):
    # a guess served at full precision would change which misses the approximation computes
    store = direct_store(mixtral_q8, 16, miss_lowbit="q4_0", prefetch="gate", policy="admit:2")
    assert store.lookahead is None and store.residency.guess_slots == 0
    assert store.residency.policies["host"].capacity == 16


def test_a_fired_expert_is_computed_from_its_low_bit_copy(mixtral_q8):
    store = direct_store(mixtral_q8, 0, miss_lowbit="q4_0")  # no host slots: every miss fires
    layer = plan(mixtral_q8)[3][0]
    copies = store.residency.lowbit
    full, copy = store.layouts[layer], copies.layouts[layer]
    file_bytes = np.memmap(mixtral_q8, dtype=np.uint8, mode="r")
    lowbit, original = {}, {}
    for (kind, part), piece, offset in zip(full.matrices.items(), copy.parts, piece_offsets(copy)):
        stack = file_bytes[part.data_start:part.data_start + part.n_experts * part.expert_bytes]
        original[kind] = dequantize_matrix(stack, Q.Q8_0, (*part.ne, part.n_experts))
        held = [copies.pool.slot(copies.index[layer, e])[offset:offset + piece.expert_bytes]
                for e in range(part.n_experts)]
        # The copy is ggml's Q4_0 of the file's dequantized values, in the expert's own slot.
        width = part.ne[0]
        assert np.array_equal(np.concatenate(held), quantize_rows(
            original[kind].reshape(-1, width).astype(np.float32), Q.Q4_0).reshape(-1))
        lowbit[kind] = dequantize_matrix(np.concatenate(held), Q.Q4_0, (*part.ne, part.n_experts))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 3], [3, 5], [7, 0], [1, 2], [6, 4]])
    weights = torch.softmax(torch.randn(5, 2, generator=torch.Generator().manual_seed(2)), 1)
    y = store.run(layer, x, ids, weights)
    near_copy = nmse(y, naive_layer(lowbit, x, ids, weights))
    near_file = nmse(y, naive_layer(original, x, ids, weights))
    # ggml rounds the activations to Q8_0 (NMSE ~3e-5 a product); Q4_0 weights cost far more.
    assert near_copy < 2e-4
    assert near_file > 10 * near_copy


def test_counters_are_exact_on_a_hand_built_routing(mixtral_q8):
    _, _, _, layers, _ = plan(mixtral_q8)
    store = direct_store(mixtral_q8, 0, miss_lowbit="q4_0")
    layer, full = layers[0], store.layouts[layers[0]].expert_bytes
    x = torch.randn(2, 64)
    store.run(layer, x, torch.tensor([[0, 1], [1, 2]]), torch.full((2, 2), 0.5))  # 3 experts
    store.run(layer, x[:1], torch.tensor([[0, 3]]), torch.full((1, 2), 0.5))  # 2 more
    s = store.stats()
    assert s["lowbit"]["fires"] == 5 and s["lowbit"]["saved_bytes"] == 5 * full
    assert s["lowbit"]["layers"][layer] == {"fires": 5, "saved_bytes": 5 * full}
    held = s["lowbit"]["held_bytes"]
    assert held == store.residency.lowbit.pool.nbytes == copies_bytes(mixtral_q8)
    assert s["lowbit"]["type"] == "q4_0"
    t = s["total"]
    assert (t["requests"], t["disk_misses"], t["disk_bytes"], t["computed_in_place"]) == (5, 0, 0, 5)
    # admit:2 with one host slot: the first expert takes the free slot (read in full), a second
    # is bypassed (fires) until its second request, when it is admitted and read in full.
    store = direct_store(mixtral_q8, 1, miss_lowbit="q4_0", policy="admit:2")
    store.run(layer, x[:1], torch.tensor([[0, 1]]), torch.full((1, 2), 0.5))
    store.run(layer, x[:1], torch.tensor([[1, 2]]), torch.full((1, 2), 0.5))
    s = store.stats()
    assert s["lowbit"]["fires"] == 2 and s["lowbit"]["saved_bytes"] == 2 * full
    t = s["total"]
    assert (t["disk_misses"], t["disk_bytes"], t["host_hits"], t["requests"]) == (2, 2 * full, 0, 4)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_budgets_hold_with_the_copies_charged(mixtral_q8, data):
    gguf, fixed, slot, layers, n_experts = plan(mixtral_q8)
    copies = copies_bytes(mixtral_q8)
    budget = fixed + copies + data.draw(st.integers(0, (len(layers) * n_experts + 1) * slot))
    store = ExpertStore(gguf, CpuKernels(1), layers, "silu", OffloadSettings(
        host_bytes=budget, miss_lowbit="q4_0",
        policy=data.draw(st.sampled_from(["lru", "lfu", "admit:2", "window:4"]))))
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        n_tokens = data.draw(st.integers(1, 4))
        ids = torch.tensor([data.draw(st.permutations(range(n_experts)))[:2]
                            for _ in range(n_tokens)])
        store.run(data.draw(st.sampled_from(layers)), torch.randn(n_tokens, 64), ids,
                  torch.rand(n_tokens, 2))
        held = store.held_bytes()["host"]
        assert held <= budget
        r = store.residency
        assert held == r.pools["host"].nbytes + fixed + r.lowbit.pool.nbytes
        assert set(store.residency.slots["host"]) == store.residency.policies["host"].resident()
    with pytest.raises(MoeswapError,
                       match=r"the --miss-lowbit copies \([\d.]+[KMG]iB\), which stay in RAM\. "
                             r"Give --host-mem [\d.]+[KMG]iB or more; .*no --miss-lowbit"):
        ExpertStore(gguf, CpuKernels(1), layers, "silu",
                    OffloadSettings(host_bytes=fixed + copies - 1, miss_lowbit="q4_0"))


def test_unsupported_types_are_refused_by_name(mixtral_q8):
    with pytest.raises(MoeswapError, match=r"--miss-lowbit q1: not a low-bit copy type .* q4_0"):
        direct_store(mixtral_q8, 0, miss_lowbit="q1")
    # the tiny model's rows are 64 wide: K-quants need 256
    with pytest.raises(MoeswapError, match=r"'blk\.0\.ffn_gate_exps\.weight' rows are 64 values "
                                           r"wide, not a multiple of its 256-value blocks"):
        direct_store(mixtral_q8, 0, miss_lowbit="q4_k")
    with pytest.raises(MoeswapError, match=r"a copy would not be smaller .* is Q8_0"):
        direct_store(mixtral_q8, 0, miss_lowbit="q8_0")


def test_run_command_counts_the_approximation(mixtral_q8, capsys):
    from moeswap.cli import main

    gguf, fixed, _, _, _ = plan(mixtral_q8)
    config = config_from_gguf(gguf)
    kv = kv_bytes_per_token(config) * (len("abc") + 1 + 3)
    working = forward_working_bytes(config, len("abc") + 1, len("abc") + 1 + 3)  # the prompt's
    host = fixed + kv + working + copies_bytes(mixtral_q8)  # no host slots left
    args = ["run", str(mixtral_q8), "-p", "abc", "-n", "3", "--temp", "0", "--threads", "1",
            "--miss-lowbit", "q4_0", "--host-mem", str(host)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert re.search(r"^miss-lowbit q4_0 \(approximation\): [1-9]\d* misses computed from low-bit "
                     r"copies, \d+\.\d MiB not read, copies hold \d+\.\d MiB$", err, re.M), err
    assert main(["run", str(mixtral_q8), "-p", "abc", "--miss-lowbit", "q4_0"]) == 2
    assert "--miss-lowbit needs the expert store: give --host-mem too" in capsys.readouterr().err
