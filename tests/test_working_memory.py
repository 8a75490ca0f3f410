"""One working-memory charge: ``forward_working_bytes``, which the planner (``moeswap plan``)
and the server's budget both reach through HostCharge, so a plan that fits is a batch the store
accepts."""

from __future__ import annotations

import pytest

import tiny_models
from moeswap.errors import MoeswapError
from moeswap.memory import forward_working_bytes, kv_cache_bytes
from moeswap.formats.config import ModelConfig


def test_forward_working_bytes_by_hand():
    """V 32, H 4, D 64: 16D = 1024 floats of activations; 2 experts a token of width 256
    hold K(3F + D) = 2 x 832 = 1664, more, so those are charged; one logits row 2V per
    sequence in the step."""
    c = ModelConfig(arch="qwen3moe", n_vocab=32, n_embd=64, n_layer=2, n_head=4, n_head_kv=2,
                    n_ctx_train=256, rms_eps=1e-6, n_expert=8, n_expert_used=2, n_ff_exp=256)
    per_token = 2 * 4 * 100 + 2 * (3 * 256 + 64)
    logits_row = 2 * 32
    assert forward_working_bytes(c, 16, 100) == 4 * (16 * per_token + logits_row)
    assert forward_working_bytes(c, 0, 100) == 4 * (100 * per_token + logits_row)  # a context
    assert forward_working_bytes(c, 512, 100) == 4 * (100 * per_token + logits_row)  # no more
    assert forward_working_bytes(c, 512, 100, sequences=3) == 4 * (300 * per_token
                                                                   + 3 * logits_row)
    narrow = ModelConfig(arch="qwen3moe", n_vocab=32, n_embd=64, n_layer=2, n_head=4,
                         n_head_kv=2, n_ctx_train=256, rms_eps=1e-6, n_expert=8,
                         n_expert_used=2, n_ff_exp=16)
    assert forward_working_bytes(narrow, 1, 10) == 4 * (64 + 80 + 16 * 64)  # 16D is larger


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.gguf_tools.convert import convert

    folder = tmp_path_factory.mktemp("gpt_oss")
    tiny_models.save("gpt_oss", folder / "hf", sliding_window=5)
    return GGUFFile.open(convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0"))


@pytest.mark.parametrize("ctx, batch, step", [(32, 1, 512), (32, 2, 512), (32, 2, 4),
                                               (1000, 3, 16), (8, 8, 8), (100, 4, 7)])
def test_plan_fits_exactly_when_serve_accepts(tiny_gguf, ctx, batch, step):
    """At the planner's need, check_fits passes and the store `moeswap serve` builds accepts
    its charge; a byte less, both refuse. Steps longer than the batch's contexts included:
    both charge no more tokens than the contexts hold."""
    from moeswap.experts.store import ExpertStore
    from moeswap.experts.settings import OffloadSettings
    from moeswap.formats.config import config_from_gguf
    from moeswap.planner.placement import Budget, check_fits
    from moeswap.planner.sizes import model_sizes
    from moeswap.quant import CpuKernels
    from moeswap.server.batching import BatchOptions
    from moeswap.server.budget import batch_charge

    config, sizes = config_from_gguf(tiny_gguf), model_sizes(tiny_gguf)
    options = BatchOptions(max_batch=batch, ctx=ctx, step_tokens=step)
    need = (sizes.shared_bytes + kv_cache_bytes(config, ctx, batch, step)
            + forward_working_bytes(config, step, ctx, batch)
            + max(sizes.top_k, 1) * sizes.slot_bytes)
    for host, fits in [(need, True), (need - 1, False)]:
        budget = Budget(device_bytes=0, host_bytes=host, context=ctx, batch=batch,
                        step_tokens=step)
        settings = OffloadSettings(host_bytes=host)
        if fits:
            check_fits(sizes, budget)
            ExpertStore(tiny_gguf, CpuKernels(1), config.moe_layers, config.expert_act,
                        settings, batch_charge(options))
        else:
            with pytest.raises(MoeswapError):
                check_fits(sizes, budget)
            with pytest.raises(MoeswapError):
                ExpertStore(tiny_gguf, CpuKernels(1), config.moe_layers, config.expert_act,
                            settings, batch_charge(options))
