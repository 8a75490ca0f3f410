"""The expert store: logits bit-identical to the fully resident model at every budget, policy
and miss mode, for every MoE family's tiny model in Q8_0 and Q4_0; budgets that hold; metrics.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tiny_models
from moeswap.errors import MoeswapError
from moeswap.memory import forward_working_bytes, kv_bytes_per_token
from moeswap.experts.store import ExpertStore, shared_bytes
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.tiers import piece_offsets, slot_bytes
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.gguf_tools.convert import convert
from moeswap.models import load_model
from moeswap.models.quant_experts import ExpertLayout, QuantResidentExperts
from moeswap.quant import CpuKernels

# One tiny config per family: gemma3 is dense; deepseek2_lite and gemma4_multimodal are other
# forms of deepseek2 and gemma4 whose routed experts are laid out the same way.
MOE_FAMILIES = [f for f in tiny_models.FAMILIES
                if f not in ("gemma3", "deepseek2_lite", "gemma4_multimodal")]
PROMPT = torch.randint(0, tiny_models.VOCAB, (12,), generator=torch.Generator().manual_seed(5))
POLICIES = ["lru", "lfu", "lfuda", "arc", "s3fifo", "window:4", "admit:2"]


@pytest.fixture(scope="module", params=[(f, t) for f in MOE_FAMILIES for t in ("q8_0", "q4_0")],
                ids=lambda ft: f"{ft[0]}-{ft[1]}")
def quantized_file(request, tmp_path_factory):
    family, out_type = request.param
    folder = tmp_path_factory.mktemp(f"{family}-{out_type}-")
    tiny_models.save(family, folder / "hf")
    return convert(folder / "hf", folder / f"model.{out_type}.gguf", out_type)


def plan(path) -> tuple[int, int, list[int], int]:
    """(fixed host bytes: shared weights and staging slots, slot bytes, MoE layers, experts per
    layer) of a file."""
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    layouts = [ExpertLayout.from_file(gguf, i) for i in config.moe_layers]
    slot = slot_bytes(layouts)
    fixed = shared_bytes(gguf, config.moe_layers) + config.n_expert_used * slot
    return fixed, slot, config.moe_layers, layouts[0].n_experts


def decode_logits(model) -> torch.Tensor:
    """A prefill of 8 tokens, then 4 decode steps: [12, V]."""
    cache = model.new_cache()
    parts = [model.forward([PROMPT[:8]], [cache])[0]]
    parts += [model.forward([PROMPT[i:i + 1]], [cache])[0] for i in range(8, 12)]
    return torch.cat(parts)


def store_model(path, host_slots: int, device_slots: int = 0, **options):
    """(model, its store's factory) with room for that many experts per tier."""
    fixed, slot, _, _ = plan(path)
    factory = build_store(OffloadSettings(
        host_bytes=fixed + host_slots * slot, device_bytes=device_slots * slot, **options))
    return load_model(path, threads=1, expert_runner=factory), factory


def assert_offload_equals_resident(path) -> list[int]:
    """A store with one host slot per MoE layer gives the resident model's logits bit for bit
    while reading experts from the file; returns the MoE layers the plan found."""
    resident = decode_logits(load_model(path, threads=1, expert_runner=QuantResidentExperts))
    _, _, layers, _ = plan(path)
    model, factory = store_model(path, len(layers))
    assert torch.equal(decode_logits(model), resident)
    assert factory.stats()["total"]["disk_misses"] > 0
    return layers


def test_store_logits_are_bitwise_the_resident_models(quantized_file):
    # One kernel thread: on a shared 2-core machine a second ggml worker stalls every call.
    resident = load_model(quantized_file, threads=1, expert_runner=QuantResidentExperts)
    expected = decode_logits(resident)
    _, _, layers, n_experts = plan(quantized_file)
    everything = len(layers) * n_experts
    # host slots, device slots, policy, miss: one expert per layer up to everything, each miss
    # mode; the policies take turns across the families (every one runs in the property test).
    turn = MOE_FAMILIES.index(quantized_file.parent.name.split("-")[0]) % len(POLICIES)
    grid = [(len(layers), 0, POLICIES[turn], "compute"),
            (0, len(layers), POLICIES[(turn + 1) % len(POLICIES)], "transfer"),
            (len(layers), 2 * len(layers), POLICIES[(turn + 2) % len(POLICIES)], "auto"),
            (everything, everything, "lru", "transfer")]
    for host_slots, device_slots, policy, miss in grid:
        model, factory = store_model(quantized_file, host_slots, device_slots, policy=policy,
                                     miss=miss)
        assert torch.equal(decode_logits(model), expected), (host_slots, device_slots, policy, miss)
        assert factory.stats()["total"]["requests"] > 0


def test_misses_are_counted_by_tier(quantized_file):
    _, _, layers, n_experts = plan(quantized_file)
    model, factory = store_model(quantized_file, len(layers) * n_experts)
    decode_logits(model)
    total = factory.stats()["total"]
    # Every expert is read from disk once, then stays in its host slot.
    assert total["disk_misses"] <= len(layers) * n_experts
    assert total["disk_misses"] + total["host_hits"] == total["requests"]
    assert total["device_hits"] == total["transfers"] == 0
    model, factory = store_model(quantized_file, 0, len(layers) * n_experts, miss="transfer")
    decode_logits(model)
    total = factory.stats()["total"]
    assert total["transfers"] == total["disk_misses"]
    assert total["device_hits"] + total["disk_misses"] == total["requests"]


def test_budget_below_the_shared_weights_is_refused(quantized_file):
    fixed, _, _, _ = plan(quantized_file)
    with pytest.raises(MoeswapError, match="below the shared weights"):
        load_model(quantized_file, threads=1,
                   expert_runner=build_store(OffloadSettings(fixed - 1)))


def test_threshold_is_an_approximation_that_is_counted(quantized_file):
    _, _, layers, n_experts = plan(quantized_file)
    # the threshold is on the routing weights as the experts get them: DeepSeek's are scaled
    scale = config_from_gguf(GGUFFile.open(quantized_file)).expert_weights_scale
    model, factory = store_model(quantized_file, len(layers) * n_experts, threshold=0.45 * scale)
    decode_logits(model)
    total = factory.stats()["total"]
    assert total["threshold_drops"] > 0


@pytest.fixture(scope="module")
def mixtral_q8(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store_property")
    tiny_models.save("mixtral", folder / "hf", num_local_experts=8)
    return convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")


def test_threshold_equals_a_hand_thresholded_resident_run(mixtral_q8):
    """--expert-threshold 0.25 on four picks per token equals the resident runner given the
    weights docs/OFFLOAD.md describes: picks under 0.25 weigh 0, a token's top pick is kept even
    when under it, and the kept weights are rescaled to the original sum."""
    gguf = GGUFFile.open(mixtral_q8)
    fixed, slot, layers, n_experts = plan(mixtral_q8)
    kernels = CpuKernels(1)
    store = ExpertStore(gguf, kernels, layers, "silu",
                        OffloadSettings(host_bytes=fixed + n_experts * slot, threshold=0.25))
    resident = QuantResidentExperts(gguf, kernels, layers, "silu")
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [1, 3, 5, 7]])  # [3, 4]
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1],  # two kept, rescaled to sum 1.0
                            [0.2, 0.24, 0.1, 0.05],  # all under: the top pick alone, 0.59
                            [0.5, 0.25, 0.25, 0.0]])  # at the threshold is kept
    by_hand = torch.tensor([[0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0],
                            [0.0, 0.59, 0.0, 0.0],
                            [0.5, 0.25, 0.25, 0.0]])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    got = store.run(layers[0], x, ids, weights)
    expected = resident.run(layers[0], x, ids, by_hand)
    assert float((got - expected).abs().max()) <= 1e-6 * float(expected.abs().max())
    assert store.stats()["layers"][layers[0]]["threshold_drops"] == 6


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_budgets_hold_and_accounting_equals_the_bytes_held(mixtral_q8, data):
    gguf = GGUFFile.open(mixtral_q8)
    fixed, slot, layers, n_experts = plan(mixtral_q8)
    everything = len(layers) * n_experts
    host_budget = fixed + data.draw(st.integers(0, (everything + 1) * slot), label="host extra")
    device_budget = data.draw(st.integers(0, (everything + 1) * slot), label="device budget")
    options = OffloadSettings(host_bytes=host_budget, device_bytes=device_budget,
                           policy=data.draw(st.sampled_from(POLICIES)),
                           miss=data.draw(st.sampled_from(["auto", "compute", "transfer"])))
    kernels = CpuKernels(1)
    store = ExpertStore(gguf, kernels, layers, "silu", options)
    resident = QuantResidentExperts(gguf, kernels, layers, "silu")
    file_bytes = np.memmap(mixtral_q8, dtype=np.uint8, mode="r")
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        layer = data.draw(st.sampled_from(layers))
        n_tokens = data.draw(st.integers(1, 5))
        ids = torch.tensor([data.draw(st.permutations(range(n_experts)))[:2]
                            for _ in range(n_tokens)])
        weights = torch.rand(n_tokens, 2)
        x = torch.randn(n_tokens, 64)
        assert torch.equal(store.run(layer, x, ids, weights), resident.run(layer, x, ids, weights))
        held = store.held_bytes()
        for tier, budget in (("host", host_budget), ("device", device_budget)):
            assert held[tier] <= budget
            assert set(store.residency.slots[tier]) == store.residency.policies[tier].resident()
            assert len(store.residency.slots[tier]) <= store.residency.pools[tier].n_slots
            for (lay, expert), index in store.residency.slots[tier].items():  # that expert's bytes
                layout = store.layouts[lay]
                in_slot = store.residency.pools[tier].slot(index)
                for part, offset in zip(layout.parts, piece_offsets(layout)):
                    start = part.data_start + expert * part.expert_bytes
                    assert np.array_equal(in_slot[offset:offset + part.expert_bytes],
                                          file_bytes[start:start + part.expert_bytes])
        assert held["host"] == store.residency.pools["host"].nbytes + fixed


def test_run_command_reports_the_store(tmp_path, capsys):
    from gguf_builders import mixtral

    from moeswap.cli import main

    path = mixtral().write(tmp_path / "mixtral.gguf")
    fixed, slot, layers, _ = plan(path)
    config = config_from_gguf(GGUFFile.open(path))
    kv = kv_bytes_per_token(config) * (len("abc") + 1 + 3)
    working = forward_working_bytes(config, len("abc") + 1, len("abc") + 1 + 3)  # the prompt's
    args = ["run", str(path), "-p", "abc", "-n", "3", "--temp", "0", "--policy", "lfu",
            "--threads", "1", "--host-mem", str(fixed + kv + working + len(layers) * slot)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert re.search(r"^experts: \d+ used, hit rate", err, re.M), err
    assert re.search(rf"^host tier: \d+/{len(layers)} slots of {slot} bytes", err, re.M), err
    assert "layer 1: hit rate" in err
    assert main(["run", str(path), "-p", "abc", "--host-mem", "1KiB"]) == 2
    assert "below the shared weights" in capsys.readouterr().err


@pytest.fixture(scope="module", params=["q8_0", "q4_0"])
def calm_mixtral(request, tmp_path_factory):
    """Weights of std 0.02: a model where one rounding difference does not grow (see
    test_quant_forward), so that two kernels can be compared with a tight bound."""
    folder = tmp_path_factory.mktemp("calm")
    tiny_models.save("mixtral", folder / "hf", initializer_range=0.02)
    return convert(folder / "hf", folder / f"model.{request.param}.gguf", request.param)


def test_torch_device_tier_agrees_with_the_cpu_kernels(calm_mixtral):
    """The device path (written for CUDA) on CPU tensors: uploads through the staging ring,
    products dequantized on the device with ggml's activation rounding."""
    assert_device_tier_agrees(calm_mixtral)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda)")
def test_cuda_device_tier_agrees_with_the_cpu_kernels(calm_mixtral):
    """The real copy path on a GPU: pinned staging ring, copy stream and events, products on the
    GPU (scripts/device_check.py measures it further)."""
    assert_device_tier_agrees(calm_mixtral, "cuda")


def assert_device_tier_agrees(path, backend: str = "cpu") -> None:
    """A torch "device" tier (CPU tensors unless backend is "cuda") of one expert per layer,
    then of every expert (--miss transfer): logits within 1e-4 of the resident model's largest,
    every argmax equal."""
    resident = load_model(path, threads=1, expert_runner=QuantResidentExperts)
    expected = decode_logits(resident)
    _, _, layers, n_experts = plan(path)
    for device_slots in (len(layers), len(layers) * n_experts):
        model, factory = store_model(path, 1, device_slots, miss="transfer",
                                     device_backend=backend)
        got = decode_logits(model)
        assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-4
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        total = factory.stats()["total"]
        assert total["transfers"] > 0
    assert total["device_hits"] > 0  # with room for every expert, the second use is a hit


def test_uploads_through_the_staging_ring_land_in_their_slots():
    from moeswap.experts.device import TorchDeviceSlots

    slots = TorchDeviceSlots("cpu", 3, 64, ring=2)
    sources = [np.full(64, i, dtype=np.uint8) for i in range(5)]
    for i, source in enumerate(sources[:3]):
        slots.upload(slots.take(("layer", i)), source)
    slots.release(1)
    slots.upload(slots.take(("layer", 3)), sources[3])  # reuses slot 1 and ring buffer 1
    assert [int(slots.slot(i)[0]) for i in range(3)] == [0, 3, 2]
    assert slots.holder == {0: ("layer", 0), 1: ("layer", 3), 2: ("layer", 2)}


def test_anonymous_memory_grows_by_the_budget_not_by_the_experts(tmp_path):
    """A ~0.2 GB generated model run from disk in a fresh process (the offload suite's worker):
    RssAnon growth stays under the host budget + 10 %, far below the routed bytes.
    The >= 2 GB run is `moeswap bench --suite offload rss` (docs/OFFLOAD.md)."""
    from moeswap.bench.generated import mixtral_shape, write_mixtral
    from moeswap.bench.suites.offload import measure_share

    from moeswap.tokenizer import load_tokenizer

    path = tmp_path / "model.gguf"
    write_mixtral(path, mixtral_shape(0.2, tiny=False))
    # The tokenizer conversion's memory is not the store's: the worker finds it in the cache
    # (this run's XDG_CACHE_HOME, which the worker inherits), as a second run would.
    load_tokenizer(path)
    r = measure_share(str(path), 0.25, "lru", 1, 8, 4, None, tmp_path / "runs", "rss")
    assert r["rss_anon_growth"] <= 1.10 * r["host_budget"]
    # the shared weights are copied into anonymous memory (charged to the budget); beside them
    # the experts did not pile up
    assert r["rss_anon_growth"] - r["shared_bytes"] < 0.5 * r["routed_bytes"]
    assert r["disk_mib"] > 0


def test_profile_policies_run_exactly_and_pin_by_model_layer(tmp_path):
    from moeswap.routing.policies import ReuseTable
    from moeswap.routing.profile import Profile

    folder = tmp_path / "m"
    tiny_models.save("deepseek2", folder / "hf")  # layer 0 is dense: traced layer i is block i+1
    path = convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")
    _, _, layers, n_experts = plan(path)
    assert layers == [1, 2]
    table = ReuseTable(age_edges=(1, 4, 1 << 30), window=4,
                       expected_gap=tuple(tuple(float(10 * a + 5 - f) for f in range(5))
                                          for a in range(3)))
    profile = Profile("tiny", "deepseek2", layers, n_experts, 3, 2, [(1, 5), (0, 2)],
                      [[1] * n_experts] * 2, table, "test")
    profile.save(tmp_path / "profile.json")
    expected = decode_logits(load_model(path, threads=1, expert_runner=QuantResidentExperts))
    for policy in ("pinned", "learned"):
        model, factory = store_model(path, 3, policy=f"{policy}:{tmp_path / 'profile.json'}")
        if policy == "pinned":  # loaded before the first token, under model block indices
            assert {(2, 5), (1, 2)} <= set(factory.store.residency.slots["host"])
        assert torch.equal(decode_logits(model), expected), policy
        if policy == "pinned":
            assert {(2, 5), (1, 2)} <= set(factory.store.residency.slots["host"])


def test_a_pinned_hot_set_is_held_once_across_the_tiers(tmp_path):
    from moeswap.routing.policies import ReuseTable
    from moeswap.routing.profile import Profile

    folder = tmp_path / "m"
    tiny_models.save("deepseek2", folder / "hf")  # MoE blocks 1 and 2
    path = convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")
    _, _, layers, n_experts = plan(path)
    table = ReuseTable(age_edges=(1, 1 << 30), window=2, expected_gap=((1.0,) * 3,) * 2)
    Profile("tiny", "deepseek2", layers, n_experts, 3, 3, [(1, 5), (0, 2), (1, 1)],
            [[1] * n_experts] * 2, table, "test").save(tmp_path / "profile.json")
    expected = decode_logits(load_model(path, threads=1, expert_runner=QuantResidentExperts))
    model, factory = store_model(path, 3, device_slots=1, policy=f"pinned:{tmp_path / 'profile.json'}")
    store = factory.store
    assert set(store.residency.slots["device"]) == {(2, 5)}
    assert set(store.residency.slots["host"]) == {(1, 2), (2, 1)}  # not the device's hot one
    assert torch.equal(decode_logits(model), expected)



def test_a_miss_never_evicts_an_expert_of_its_own_step(mixtral_q8):
    """LFU with 2 host slots: expert 3, requested four times, outranks expert 0 (once). The step
    (0, 1) then hits 0; 1's miss would evict 0, the least used, and 0 would be read again for
    the step's second pass. Instead 0 stays and 1 is computed from the staging ring."""
    gguf = GGUFFile.open(mixtral_q8)
    fixed, slot, layers, _ = plan(mixtral_q8)
    kernels = CpuKernels(1)
    store = ExpertStore(gguf, kernels, layers, "silu",
                        OffloadSettings(host_bytes=fixed + 2 * slot, policy="lfu"))
    resident = QuantResidentExperts(gguf, kernels, layers, "silu")
    layer = layers[0]
    for pair in ([3, 4], [3, 5], [3, 6], [3, 0], [0, 1]):
        ids = torch.tensor([pair])  # [1, 2]
        x, weights = torch.randn(1, 64), torch.rand(1, 2)
        assert torch.equal(store.run(layer, x, ids, weights), resident.run(layer, x, ids, weights))
    stats = store.stats()["layers"][layer]
    assert stats["refetches"] == 0
    assert set(store.residency.slots["host"]) == {(layer, 3), (layer, 0)}
