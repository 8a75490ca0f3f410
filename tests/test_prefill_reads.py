"""A long forward (a prefill) reads each expert it needs once, however many of its pieces of
MAX_TOKENS_PER_CALL tokens pick it, and its logits stay the resident model's bit for bit."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import tiny_models
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.store import shared_bytes
from moeswap.experts.tiers import slot_bytes
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.gguf_tools.convert import convert
from moeswap.models import load_model
from moeswap.models.quant_experts import ExpertLayout, QuantResidentExperts
from moeswap.quant import MAX_TOKENS_PER_CALL

PROMPT = torch.randint(0, tiny_models.VOCAB, (5 * MAX_TOKENS_PER_CALL - 3,),
                       generator=torch.Generator().manual_seed(19))  # five pieces, the last short
# Eight plain experts, GPT-OSS's biases and clamped activation, Gemma 4's output scales.
MODELS = [("mixtral", "q8_0", {"num_local_experts": 8}), ("mixtral", "q4_0", {}),
          ("gpt_oss", "q8_0", {}), ("gemma4", "q8_0", {})]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"{m[0]}-{m[1]}")
def model_file(request, tmp_path_factory):
    family, out_type, overrides = request.param
    folder = tmp_path_factory.mktemp(f"{family}-{out_type}-")
    tiny_models.save(family, folder / "hf", **overrides)
    return convert(folder / "hf", folder / f"model.{out_type}.gguf", out_type)


def store_model(path, host_slots: int, device_slots: int, **options):
    """(model, store factory) with room for that many experts per tier besides what the host
    budget pays first (shared weights, the staging ring)."""
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    slot = slot_bytes([ExpertLayout.from_file(gguf, i) for i in config.moe_layers])
    fixed = shared_bytes(gguf, config.moe_layers) + config.n_expert_used * slot
    factory = build_store(OffloadSettings(host_bytes=fixed + host_slots * slot,
                                          device_bytes=device_slots * slot, **options))
    return load_model(path, threads=1, expert_runner=factory), factory


def prefill(model) -> torch.Tensor:
    """The whole prompt as one forward -> logits [N, V]."""
    return model.forward([PROMPT], [model.new_cache()])[0]


# (host slots, device slots, miss): every miss through the staging ring (more misses than ring
# slots: the ring streams); one host slot; more host slots than a step's ring; device slots
# (no overlap: each expert computed as it is served).
BUDGETS = [(0, 0, "compute"), (1, 0, "compute"), (5, 0, "compute"), (0, 3, "transfer")]


@pytest.mark.parametrize("host_slots, device_slots, miss", BUDGETS)
def test_a_prefill_reads_each_needed_expert_once(model_file, host_slots, device_slots, miss):
    expected = prefill(load_model(model_file, threads=1, expert_runner=QuantResidentExperts))
    model, factory = store_model(model_file, host_slots, device_slots, miss=miss,
                                 prefetch="off")
    store = factory.store
    picked: dict[tuple[int, int], set[int]] = {}  # (layer, expert) -> pieces picking it
    reads: Counter = Counter()  # (tensor, expert) -> times its bytes were read
    run, read_piece = store.run, store.residency.disk.read_piece

    def spied_run(layer, x, ids, weights):
        for token, row in enumerate(ids.tolist()):
            for expert in row:
                picked.setdefault((layer, expert), set()).add(token // MAX_TOKENS_PER_CALL)
        return run(layer, x, ids, weights)

    def counted_read(part, expert, target):
        reads[part.name, expert] += 1
        read_piece(part, expert, target)

    store.run, store.residency.disk.read_piece = spied_run, counted_read
    assert torch.equal(prefill(model), expected)
    # The premise: experts are needed by several pieces of the forward (the store starts empty).
    assert max(map(len, picked.values())) >= 4
    read_experts = {(int(name.split(".")[1]), expert) for name, expert in reads}
    assert read_experts == set(picked)
    assert set(reads.values()) == {1}  # each piece of each expert read once
    total = factory.stats()["total"]
    assert total["disk_misses"] == total["requests"] == len(picked)
    assert total["refetches"] == 0
    layouts = store.layouts
    assert total["disk_bytes"] == sum(layouts[layer].expert_bytes for layer, _ in picked)


@pytest.fixture(scope="module")
def calm_mixtral(tmp_path_factory):
    """Weights of std 0.02, so that the torch device tier's roundings stay within a tight bound
    (tests/test_expert_store.py, assert_device_tier_agrees)."""
    folder = tmp_path_factory.mktemp("calm")
    tiny_models.save("mixtral", folder / "hf", initializer_range=0.02, num_local_experts=8)
    return convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")


def test_a_torch_device_tier_reads_each_needed_expert_once(calm_mixtral):
    """Device slots computed by torch (on CPU tensors here) take each expert's picks of the whole
    forward at once: one read per expert, and three slots give the logits of a slot for every
    expert bit for bit (near the resident model's: the device tier dequantizes and multiplies in
    torch, 3e-3 of the largest logit over this prompt, as before the step was the forward)."""
    everything = len(config_from_gguf(GGUFFile.open(calm_mixtral)).moe_layers) * 8
    logits = {}
    for slots in (3, everything):
        model, factory = store_model(calm_mixtral, 0, slots, miss="transfer",
                                     device_backend="cpu", prefetch="off")
        logits[slots] = prefill(model)
        total = factory.stats()["total"]
        assert total["transfers"] == total["disk_misses"] == total["requests"] == everything
        assert total["refetches"] == 0
    assert torch.equal(logits[3], logits[everything])
    expected = prefill(load_model(calm_mixtral, threads=1, expert_runner=QuantResidentExperts))
    assert float((logits[3] - expected).abs().max() / expected.abs().max()) <= 1e-2
