"""Split GGUF sets (llama.cpp's gguf-split layout, written here by gguf-py's GGUFWriter) read as
one model everywhere: the reader from any piece, the engine and the expert store (one descriptor
per piece, opened at its first read), inspect, doctor, fix (same layout or --merge), plan, and
llama.cpp itself on the same set.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import tiny_models
from split_builders import SPLIT_MUTATIONS, piece, split_copy

from moeswap.cli import main
from moeswap.errors import GGUFFormatError, MoeswapError
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.tiers import DiskReader
from moeswap.formats.gguf_file import GGUFFile
from moeswap.gguf_tools import fix
from moeswap.gguf_tools.doctor import diagnose
from moeswap.gguf_tools.inspect import inspect_file
from moeswap.models import load_model
from moeswap.models.quant_experts import ExpertLayout
from moeswap.planner.sizes import model_sizes

PROMPT = torch.randint(0, tiny_models.VOCAB, (10,), generator=torch.Generator().manual_seed(9))
PIECES = 3


@pytest.fixture(scope="module")
def single(mixtral_file):
    """The one file the set is split from: conftest's tiny Mixtral."""
    return mixtral_file


@pytest.fixture(scope="module")
def split_set(single, tmp_path_factory):
    return split_copy(single, tmp_path_factory.mktemp("set") / "model.gguf", PIECES)


def logits(path, **load) -> torch.Tensor:
    model = load_model(path, threads=1, **load)
    cache = model.new_cache()
    steps = [model.forward([PROMPT[:6]], [cache])[0]]
    steps += [model.forward([PROMPT[i:i + 1]], [cache])[0] for i in range(6, len(PROMPT))]
    return torch.cat(steps)


def tensor_bytes(path) -> dict[str, bytes]:
    gf = GGUFFile.open(path)
    try:
        return {t.name: bytes(gf.tensor_bytes(t)) for t in gf.tensors}
    finally:
        gf.close()


@pytest.mark.parametrize("number", range(1, PIECES + 1))
def test_any_piece_opens_the_whole_set(single, split_set, number):
    gf = GGUFFile.open(piece(split_set, number))
    assert gf.path == split_set and len(gf.pieces) == PIECES
    assert {t.piece for t in gf.tensors} == set(range(PIECES))
    assert gf.get("general.architecture") == "llama"
    gf.close()
    assert tensor_bytes(piece(split_set, number)) == tensor_bytes(single)


def test_a_missing_piece_is_one_line_naming_it(split_set, tmp_path, capsys):
    for n in range(1, PIECES + 1):
        (tmp_path / piece(split_set, n).name).write_bytes(piece(split_set, n).read_bytes())
    first = tmp_path / split_set.name
    piece(first, 3).unlink()
    with pytest.raises(GGUFFormatError, match=rf"^{piece(first, 3)}: piece 3 of 3 of the split "
                                              "set is missing; download it"):
        GGUFFile.open(piece(first, 2))
    assert main(["inspect", str(first)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(piece(first, 3)) in err and "Traceback" not in err


def test_logits_equal_the_single_files_resident_and_offloaded(single, split_set):
    expected = logits(single)
    assert torch.equal(logits(split_set), expected)
    gf = GGUFFile.open(split_set)
    sizes = model_sizes(gf)
    gf.close()
    # The shared weights, top-k staging slots and two expert slots (of 8 experts): most
    # experts are read from whichever piece holds them, again and again.
    top_k = 2
    factory = build_store(OffloadSettings(
        host_bytes=sizes.shared_bytes + (top_k + 2) * sizes.slot_bytes))
    assert torch.equal(logits(piece(split_set, 2), expert_runner=factory), expected)
    assert factory.store.residency.disk.stats.bytes > 8 * sizes.one_expert_bytes


def test_the_store_opens_one_descriptor_per_piece_at_its_first_read(split_set):
    gf = GGUFFile.open(split_set)
    layouts = [ExpertLayout.from_file(gf, i) for i in range(2)]
    files = {part.file for layout in layouts for part in layout.parts}
    assert len(files) > 1  # the experts lie in more than one piece
    reader = DiskReader(gf.piece_paths)
    assert reader.files == {}
    for layout in layouts:
        slot = np.empty(layout.expert_bytes + 32 * len(layout.parts), dtype=np.uint8)
        for expert in range(layout.n_experts):
            reader.read_expert(layout, expert, slot)
            raw = bytes(gf.tensor_bytes(gf.tensor(layout.parts[0].name)))
            size = layout.parts[0].expert_bytes
            assert bytes(slot[:size]) == raw[expert * size:(expert + 1) * size]
    assert set(reader.files) == files
    reader.close()
    gf.close()


def test_inspect_shows_the_set_and_each_piece(single, split_set, capsys):
    whole, one = inspect_file(split_set), inspect_file(single)
    assert whole.totals == one.totals and whole.n_tensors == one.n_tensors
    assert [p.path for p in whole.pieces] == [str(piece(split_set, n)) for n in (1, 2, 3)]
    assert sum(p.n_tensors for p in whole.pieces) == whole.n_tensors
    assert whole.file_size == sum(piece(split_set, n).stat().st_size for n in (1, 2, 3))
    assert main(["inspect", str(piece(split_set, 3)), "--json", "--tensors"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["pieces"]) == 3 and {t["piece"] for t in data["tensors"]} == {0, 1, 2}
    assert main(["inspect", str(split_set)]) == 0
    out = capsys.readouterr().out
    assert "split set of 3 files" in out and "2/3" in out


def test_doctor_finds_a_clean_set_clean(split_set):
    assert diagnose(piece(split_set, 2)).findings == []


def test_plan_counts_every_piece(single, split_set):
    whole, one = GGUFFile.open(split_set), GGUFFile.open(single)
    a, b = model_sizes(whole), model_sizes(one)
    assert (a.total_bytes, a.routed_bytes, a.shared_bytes, a.slot_bytes, a.layer_bytes) == \
        (b.total_bytes, b.routed_bytes, b.shared_bytes, b.slot_bytes, b.layer_bytes)
    whole.close()
    one.close()


@pytest.mark.parametrize("mutation", [m for m in SPLIT_MUTATIONS if m.repairable],
                         ids=lambda m: m.name)
def test_fix_writes_a_set_of_the_same_layout(mutation, tmp_path):
    first = mutation.build(tmp_path)
    before = {n: piece(first, n).read_bytes() for n in range(1, 4)}
    result = fix.fix_file(first, tmp_path / "fixed.gguf")
    assert result.output == tmp_path / "fixed-00001-of-00003.gguf"
    assert {n: piece(first, n).read_bytes() for n in range(1, 4)} == before
    assert diagnose(result.output).findings == []
    assert tensor_bytes(result.output) == tensor_bytes(first)
    src, dst = GGUFFile.open(first), GGUFFile.open(result.output)
    assert [(t.name, t.piece) for t in dst.tensors] == [(t.name, t.piece) for t in src.tensors]
    src.close()
    dst.close()
    assert not list(tmp_path.glob(".*.tmp"))


def test_fix_merge_writes_one_file(single, split_set, tmp_path, capsys):
    out = tmp_path / "merged.gguf"
    assert main(["fix", str(piece(split_set, 2)), "-o", str(out), "--merge"]) == 0
    assert f"wrote {out} (doctor: clean)" in capsys.readouterr().out
    merged = GGUFFile.open(out)
    assert merged.pieces == [] and not [k for k in merged.kv if k.startswith("split.")]
    merged.close()
    assert tensor_bytes(out) == tensor_bytes(single)
    assert torch.equal(logits(out), logits(single))


def test_fix_of_a_set_never_overwrites_a_piece(split_set):
    with pytest.raises(MoeswapError, match="is an input file"):
        fix.fix_file(split_set, piece(split_set, 2), merge=True)


@pytest.mark.llama_cpp
def test_llama_cpp_computes_the_same_logits_from_the_set(single, split_set):
    pytest.importorskip("llama_cpp", reason="compares against llama-cpp-python")
    from test_llama_cpp_logits import llama_cpp_logits, moeswap_logits
    from tiny_models import relative_error

    reference = llama_cpp_logits(single)
    assert np.array_equal(llama_cpp_logits(split_set), reference)
    # moeswap on the set: its single file's logits, and llama.cpp's within the Q8_0 bound of
    # tests/test_llama_cpp_logits.py (both engines round activations to Q8_0 alike).
    assert np.array_equal(moeswap_logits(split_set), moeswap_logits(single))
    assert relative_error(moeswap_logits(split_set), reference) <= 1e-4
