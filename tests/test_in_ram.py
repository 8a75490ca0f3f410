"""A resident model's weights copied into RAM with huge pages (moeswap.formats.gguf_in_ram):
the same logits as from the mapped file, independent of the file once loaded, and the command
line's rule for when it copies (resident, fits the free RAM, no --mmap)."""

from __future__ import annotations

import shutil

import pytest
import torch

from moeswap.cli.offload_args import offload_load_options
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_in_ram import huge_pages_offered
from moeswap.memory import HostCharge
from moeswap.models import load_model
from moeswap.planner import auto

IDS = torch.tensor([1, 5, 9, 17, 33, 2, 8])


def logits(model) -> torch.Tensor:
    cache = model.new_cache()
    steps = [model.forward([IDS[:4]], [cache])[0]]
    steps += [model.forward([IDS[i:i + 1]], [cache])[0] for i in range(4, len(IDS))]
    return torch.cat(steps)


def test_the_copy_gives_the_mapped_files_bits_and_outlives_the_file(mixtral_file, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(mixtral_file, path)
    copied = load_model(path, in_ram=True)
    mapped = logits(load_model(mixtral_file))
    assert torch.equal(logits(copied), mapped)
    path.write_bytes(b"\0" * path.stat().st_size)  # the file's bytes gone: the copy computes
    assert torch.equal(logits(copied), mapped)


def test_a_store_reads_the_file_so_nothing_is_copied(mixtral_file, tmp_path):
    from test_expert_store import store_model

    path = tmp_path / "model.gguf"
    shutil.copy(mixtral_file, path)
    model, _ = store_model(path, host_slots=2)
    buffer = model.source.piece_files[0].buffer
    assert bytes(buffer[:4]) == b"GGUF"
    path.write_bytes(b"\0" * path.stat().st_size)
    assert bytes(buffer[:4]) == b"\0\0\0\0"  # still the file's own mapping


@pytest.mark.parametrize("setting, offered", [("always [madvise] never", True),
                                              ("[always] madvise never", True),
                                              ("always madvise [never]", False), ("", False)])
def test_huge_pages_are_asked_for_where_the_kernel_offers_them(tmp_path, setting, offered):
    (tmp_path / "enabled").write_text(setting)
    assert huge_pages_offered(tmp_path / "enabled") is offered
    assert huge_pages_offered(tmp_path / "missing") is False


def test_the_command_line_copies_a_resident_model_that_fits(mixtral_file, monkeypatch):
    charge = HostCharge.for_sequence(4096, 512, "f16")
    gguf = GGUFFile.open(mixtral_file)
    config = config_from_gguf(gguf)
    gguf.close()
    run = charge.kv_bytes(config) + charge.working_bytes(config)  # the caches and a step's
    size = mixtral_file.stat().st_size
    assert run > 0

    def machine(free: int):
        monkeypatch.setattr(auto, "machine_memory", lambda: auto.Machine(free, free))

    machine(size + run + auto.HOST_RESERVE)
    assert offload_load_options(None, charge, 1, mixtral_file, mmap=False)["in_ram"] is True
    assert "in_ram" not in offload_load_options(None, charge, 1, mixtral_file, mmap=True)
    machine(size + run + auto.HOST_RESERVE - 1)  # no room for the copy beside the run's memory
    assert offload_load_options(None, charge, 1, mixtral_file, mmap=False)["in_ram"] is False
    assert auto.fits_in_ram(mixtral_file.parent) is False  # a folder stays as it is


@pytest.mark.llama_cpp
def test_repacked_expert_stacks_give_their_copied_pages_back(tmp_path):
    """A resident Q4_K_M model with repacked layouts: the expert stacks ggml repacks are read
    no more, so the RAM copy's pages inside them are released (zeros now), and the logits are
    those of the model computed from the mapped file."""
    import tiny_models

    pytest.importorskip("llama_cpp", reason="llama-cpp-python quantizes Q4_K_M")
    path = tiny_models.q4_k_m_mixtral(tmp_path, num_local_experts=8)
    copied = load_model(path, repack=True, in_ram=True)
    experts = copied.layers[0].ffn.experts
    repacked = [kind for (layer, kind), stack in experts._stacks.items()
                if layer == 0 and stack.weight.keep_alive is None]
    assert repacked  # ggml repacks Q4_K stacks on this CPU
    info = copied.source.tensor(f"blk.0.ffn_{repacked[0]}_exps.weight")
    stored = bytes(copied.source.tensor_bytes(info))
    assert stored.count(0) > len(stored) // 2  # its whole pages given back
    assert torch.equal(logits(copied), logits(load_model(path, repack=True)))
