"""A long forward (a prefill) reads each expert it needs once, however many of its pieces of
MAX_TOKENS_PER_CALL tokens pick it, and its logits stay the resident model's bit for bit."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import tiny_models
from moeswap.gguf_tools.convert import convert
from moeswap.models import load_model
from moeswap.models.quant_experts import QuantResidentExperts
from moeswap.quant import MAX_TOKENS_PER_CALL
from test_expert_store import calm_mixtral, plan, store_model  # noqa: F401 (calm_mixtral: a fixture)

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

    def counted_read(part, expert, target, within=0):
        reads[part.name, expert] += 1
        read_piece(part, expert, target, within)

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


def test_a_torch_device_tier_reads_each_needed_expert_once(calm_mixtral):  # noqa: F811
    """Device slots computed by torch (on CPU tensors here) take each expert's picks of the whole
    forward at once: one read per expert, and three slots give the logits of a slot for every
    expert bit for bit, near the resident model's (the device tier dequantizes and multiplies in
    torch; over this prompt 0 for Q8_0 and 2.6e-4 of the largest logit for Q4_0, the same as
    when each 32-token piece was a step)."""
    _, _, layers, n_experts = plan(calm_mixtral)
    everything = len(layers) * n_experts
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
    assert float((logits[3] - expected).abs().max() / expected.abs().max()) <= 1e-3
