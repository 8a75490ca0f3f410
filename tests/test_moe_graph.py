"""The fused MoE feed-forward graph (moeswap/quant/moe_graph.py) against the per-matrix path it
replaced, and the exactness the expert store builds on: the same expert computed from a slot
pool, pick by pick, gives the bits of the whole stack's graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moeswap.models.quant_experts import GLUS, combine, per_matrix_step
from moeswap.quant import CpuKernels, quantize_rows
from moeswap.quant.moe_graph import MoeFfn, pool_stacks, weight_stacks

D, F, X = 256, 512, 8  # model width, expert width, experts


@pytest.fixture(scope="module")
def kernels():
    return CpuKernels(2)


def layer(kernels, ggml_type, activation, fused, seed=0):
    """Random stacks (with biases and a per-expert scale) -> (fused ffn, per-matrix reference
    ``(x, ids, weights) -> [T, D]``, stored bytes and vectors by kind)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"gate_up": (D, 2 * F)} if fused else {"gate": (D, F), "up": (D, F)}
    shapes["down"] = (F, D)
    raw = {kind: quantize_rows((torch.randn(X * out, width, generator=generator) * 0.1).numpy(),
                               ggml_type).reshape(-1) for kind, (width, out) in shapes.items()}
    vectors = {("gate_up" if fused else "gate"): torch.randn(X, 2 * F if fused else F,
                                                             generator=generator),
               "down": torch.randn(X, D, generator=generator),
               "scale": torch.rand(X, 1, generator=generator)}
    stacks = weight_stacks(
        {kind: kernels.bind(raw[kind], ggml_type, (*ne, X)) for kind, ne in shapes.items()},
        {kind: kernels.bind(v.numpy(), 0, tuple(v.shape[::-1])) for kind, v in vectors.items()})
    per_kind = {kind: kernels.experts(raw[kind], ggml_type, (*ne, X))
                for kind, ne in shapes.items()}

    def reference(x, ids, weights):
        picked = {kind: v[ids.flatten().long()] for kind, v in vectors.items()}
        return per_matrix_step(lambda kind, rows, ids: per_kind[kind].matmul(rows, ids), picked,
                               activation, fused, x, ids, weights)

    return MoeFfn(kernels, stacks, GLUS[activation]), reference, raw, vectors, shapes


def picks(n_tokens, n_picked, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(X, generator=generator)[:n_picked]
                       for _ in range(n_tokens)]).int()  # [T, K]
    return (torch.randn(n_tokens, D, generator=generator), ids,
            torch.rand(n_tokens, n_picked, generator=generator))


@pytest.mark.parametrize("ggml_type", [Q.Q8_0, Q.Q4_K])
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("fused", [False, True])
def test_the_graph_computes_the_per_matrix_path(kernels, ggml_type, activation, fused):
    """Same products on the same token groups, biases, scale, weights and the sum in the same
    order; only the activation is ggml's instead of torch's (last-bit differences in exp /
    tanh, which at most flip one rounding of the hidden row to Q8 for the down product):
    measured 0 to 7e-7 relative, bounded at 1e-5."""
    ffn, reference, *_ = layer(kernels, ggml_type, activation, fused)
    for n_tokens, n_picked in ((1, 1), (1, 2), (5, 4), (32, 2)):
        x, ids, weights = picks(n_tokens, n_picked, seed=n_tokens * 10 + n_picked)
        got, expected = ffn.run(x, ids, weights), reference(x, ids, weights)
        assert got.shape == (n_tokens, D)
        assert ((got - expected).norm() / expected.norm()).item() <= 1e-5


@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
def test_the_halves_give_the_whole_graphs_bits(kernels, activation):
    ffn, *_ = layer(kernels, Q.Q4_K, activation, fused=False)
    x, ids, weights = picks(7, 3, seed=1)
    assert torch.equal(ffn.finish(ffn.hidden(x, ids), ids, weights), ffn.run(x, ids, weights))


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q8_0])
@pytest.mark.parametrize("fused", [False, True])
def test_picks_from_a_slot_pool_give_the_stacks_bits(kernels, fused, ggml_type):
    """The store's computation: experts copied into slots of a pool (pieces at aligned offsets,
    slots in another order than the experts), each pick run as its own row (K = 1) over the
    pool's view, then summed in pick order: bit for bit the whole stack's graph (Q8_0: the
    custom op over the pool's slot strides against it over the stack's)."""
    ffn, _, raw, vectors, shapes = layer(kernels, ggml_type, "swiglu_oai", fused)
    pieces, offset = [], 0
    for kind, (width, out) in shapes.items():
        pieces.append((kind, int(ggml_type), (width, out), offset))
        offset += -(-raw[kind].nbytes // X // 32) * 32
    for kind, v in vectors.items():
        pieces.append((kind, 0, (v.shape[1],) if kind != "scale" else (), offset))
        offset += -(-v.shape[1] * 4 // 32) * 32
    slot_size, n_slots = offset + 96, X + 3
    buffer = np.zeros(n_slots * slot_size + 32, dtype=np.uint8)
    buffer = buffer[-buffer.ctypes.data % 32:][:n_slots * slot_size]
    slot_of = torch.tensor([(3 * e + 5) % n_slots for e in range(X)], dtype=torch.int32)
    for e in range(X):
        slot = buffer[int(slot_of[e]) * slot_size:][:slot_size]
        for kind, _, ne, at in pieces:  # a matrix and its bias share the kind's name
            data = (raw[kind].reshape(X, -1)[e] if len(ne) == 2
                    else vectors[kind][e].numpy().view(np.uint8))
            slot[at:at + data.nbytes] = data
    pooled = MoeFfn(kernels, pool_stacks(kernels, buffer, slot_size, pieces), GLUS["swiglu_oai"])
    x, ids, weights = picks(9, 4, seed=2)
    rows = x.repeat_interleave(4, dim=0)  # [T*K, D]: each pick's token row
    per_pick = pooled.run(rows, slot_of[ids.flatten().long()][:, None],
                          weights.flatten()[:, None])  # [T*K, D], weighted
    assert torch.equal(combine(per_pick.view(9, 4, D)), ffn.run(x, ids, weights))


def test_expert_ids_outside_the_stack_are_refused(kernels):
    ffn, *_ = layer(kernels, Q.Q8_0, "silu", fused=False)
    x, ids, weights = picks(2, 2, seed=3)
    for bad in (X, -1):
        ids[1, 0] = bad
        with pytest.raises(ValueError, match="expert ids"):
            ffn.run(x, ids, weights)


def test_a_streamed_step_reads_the_down_bias_with_the_down_matrix(tmp_path, monkeypatch):
    """GPT-OSS (biases) in a prefill with more misses than staging slots: the step's graph is
    cut at the activation and the down half is read in the second pass. Every staging slot is
    scribbled between the passes, so a down bias read only in the first pass would show."""
    import tiny_models

    from moeswap.experts.build import build_store
    from moeswap.experts.settings import OffloadSettings
    from moeswap.experts.step_reads import StepReads
    from moeswap.gguf_tools.convert import convert
    from moeswap.models import load_model
    from moeswap.models.quant_experts import QuantResidentExperts

    tiny_models.save("gpt_oss", tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "model.q8_0.gguf", "q8_0")
    prompt = torch.randint(0, tiny_models.VOCAB, (8,), generator=torch.Generator().manual_seed(4))
    resident = load_model(path, threads=1, expert_runner=QuantResidentExperts)
    expected = resident.forward([prompt], [resident.new_cache()])[0]
    second_pass, streamed = StepReads.second_pass, []

    def scribbled(self, places, stats):
        streamed.append(self.split)
        if self.split:
            self.r.staging.buffer[:] = 0x7F  # large finite fp16 / f32 garbage in every slot
        return second_pass(self, places, stats)

    monkeypatch.setattr(StepReads, "second_pass", scribbled)
    sized = build_store(OffloadSettings(host_bytes=1 << 30, prefetch="off"))
    load_model(path, threads=1, expert_runner=sized)
    no_slots = sized.store.residency.charged["host"]  # what is paid before any host slot
    store = build_store(OffloadSettings(host_bytes=no_slots, prefetch="off"))
    model = load_model(path, threads=1, expert_runner=store)
    assert torch.equal(model.forward([prompt], [model.new_cache()])[0], expected)
    assert any(streamed)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("fused", [False, True])
def test_q8_0_custom_op_gives_mul_mat_ids_bits(kernels, activation, fused):
    """The custom op for Q8_0 experts (moeswap/quant/q8_0_kernel.py) computes ggml's sums in
    ggml's order: the same bits as ``mul_mat_id`` for any tokens and picks (an expert's tokens
    4 at a time, and the remainder); beyond 4,096 picks a node keeps ``mul_mat_id``."""
    ffn, *_ = layer(kernels, Q.Q8_0, activation, fused, seed=3)
    assert ffn.custom is not None  # a C compiler is there (CI's machines have gcc)
    plain = MoeFfn(kernels, ffn.stacks, GLUS[activation])
    plain.custom = None
    for n_tokens, n_picked in ((1, 1), (1, 8), (2, 1), (3, 2), (8, 2), (13, 4), (32, 8), (64, 2)):
        x, ids, weights = picks(n_tokens, n_picked, seed=n_tokens + n_picked)
        assert torch.equal(ffn.run(x, ids, weights), plain.run(x, ids, weights))
        assert torch.equal(ffn.hidden(x, ids), plain.hidden(x, ids))
    assert ffn.custom.takes(1, 8) and ffn.custom.takes(512, 8) and not ffn.custom.takes(513, 8)


@pytest.mark.parametrize("shape", [(256, 96), (640, 4096)])
def test_dense_q8_0_products_take_the_op_with_mul_mats_bits(kernels, monkeypatch, shape):
    """``matrix_product`` (the head, attention and dense FFN matrices of a decode step): a plain
    Q8_0 weight of up to DENSE_TOKENS tokens goes through the custom op, with ``mul_mat``'s
    bits; more tokens, and a weight of another type, keep ``mul_mat``."""
    from moeswap.quant.graph_arena import Arena, new_context
    from moeswap.quant.q8_0_kernel import (DENSE_TOKENS, PRODUCT_NODES, custom_q8_0,
                                           matrix_product)

    ggml, (n_in, n_out) = kernels.ggml, shape
    op = custom_q8_0(kernels)
    assert op is not None  # a C compiler is there (CI's machines have gcc)
    taken = []
    monkeypatch.setattr(op, "product", lambda *args, product=op.product: (
        taken.append(args[-2]), product(*args))[1])
    rows = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(n_out))  # [O, I]
    weights = {kind: kernels.bind(quantize_rows(rows.numpy(), int(kind)), int(kind), shape, "w")
               for kind in (Q.Q8_0, Q.Q4_0)}

    def product(weight, x: torch.Tensor, dense: bool) -> torch.Tensor:
        context = new_context(ggml, 2 + PRODUCT_NODES)
        try:
            arena = Arena(kernels, context)
            x_in = arena.new(int(Q.F32), n_in, x.shape[0])  # (I, T)
            y = (matrix_product(kernels, context, arena, weight, x_in) if dense
                 else arena.op(ggml.ggml_mul_mat(context, weight.tensor, x_in)))  # (O, T)
            graph = ggml.ggml_new_graph_custom(context, 2 + PRODUCT_NODES, False)
            ggml.ggml_build_forward_expand(graph, y)
            out = torch.empty(x.shape[0], n_out)  # [T, O]
            kernels.run(graph, [(arena.offsets[x_in], x.data_ptr(), x.nbytes)],
                        (out.data_ptr(), out.nbytes), arena.offsets[y])
            return out
        finally:
            ggml.ggml_free(context)

    for n_tokens in (1, 2, 3, 4, 5, 8, DENSE_TOKENS + 1):
        x = torch.randn(n_tokens, n_in, generator=torch.Generator().manual_seed(n_tokens))
        for kind, weight in weights.items():
            taken.clear()
            fast = product(weight, x, dense=True)
            assert taken == ([n_tokens] if kind == Q.Q8_0 and n_tokens <= DENSE_TOKENS else [])
            assert torch.equal(fast, product(weight, x, dense=False))


def test_without_a_compiler_q8_0_experts_keep_mul_mat_id(tmp_path, monkeypatch):
    from moeswap.quant import q8_0_kernel

    monkeypatch.setenv("MOESWAP_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert q8_0_kernel._compiled.__wrapped__() is None
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written kept
    monkeypatch.delenv("CC")
    monkeypatch.setattr(q8_0_kernel.shutil, "which", lambda name: None)  # none at all
    assert q8_0_kernel._compiled.__wrapped__() is None
    monkeypatch.setenv("CC", "gcc")
    unwritable = tmp_path / "file"
    unwritable.write_text("")
    monkeypatch.setenv("MOESWAP_CACHE", str(unwritable))  # its kernels folder cannot be made
    assert q8_0_kernel._compiled.__wrapped__() is None


def test_few_picks_group_as_many_do():
    """The decode steps' plain-Python grouping (<= 16 picks) gives torch's: experts ascending,
    each with its picks ascending; and one piece holds every pick of a short step."""
    from moeswap.models import quant_experts
    from moeswap.models.quant_experts import group_picks, picks_by_piece

    generator = torch.Generator().manual_seed(4)
    for n_tokens, n_picked in ((1, 2), (1, 8), (2, 8), (4, 4), (16, 1)):
        ids = torch.randint(0, 6, (n_tokens, n_picked), generator=generator, dtype=torch.int32)
        few = group_picks(ids)
        saved, quant_experts._FEW_PICKS = quant_experts._FEW_PICKS, 0  # torch's path
        try:
            many = group_picks(ids)
        finally:
            quant_experts._FEW_PICKS = saved
        assert [e for e, _ in few] == [e for e, _ in many]
        assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(few, many))
        for _, picks in few:
            assert [p.tolist() for p in picks_by_piece(picks, n_picked)] == [picks.tolist()]
    late = torch.tensor([0, 5, 64, 65, 130])  # K = 2: tokens 0, 2, 32, 32, 65 -> three pieces
    assert [p.tolist() for p in picks_by_piece(late, 2)] == [[0, 5], [64, 65], [130]]
