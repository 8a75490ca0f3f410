"""Property: on mutated or truncated GGUF bytes, inspect and doctor never raise an unhandled
exception, and every failure they report is a named doctor rule; on the built-in model's header
fields set to any number, `run`'s loader raises nothing but MoeswapError either."""

from __future__ import annotations

import io
import struct

import pytest
from gguf_builders import deepseek2, mixtral_legacy
from hypothesis import HealthCheck, given, settings, strategies as st
from rich.console import Console

from moeswap.errors import GGUFFormatError
from moeswap.gguf_tools.doctor import RULES_BY_ID, diagnose
from moeswap.gguf_tools.inspect import inspect_file, render



@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    files = []
    for name, spec in (("deepseek2", deepseek2()), ("legacy", mixtral_legacy())):
        data = spec.write(directory / f"{name}.gguf").read_bytes()
        files.append(data)
    return directory, files


def _header_size(data: bytes) -> int:
    """Where the tensor data begins, roughly: mutations there reach the parser."""
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    return min(len(data), 64 * (n_tensors + n_kv) + 4096)


def _check(path) -> None:
    try:
        report = inspect_file(path)
    except GGUFFormatError as e:
        assert e.rule in RULES_BY_ID
    else:
        render(report, Console(file=io.StringIO(), width=120), with_tensors=True)
        report.to_json(with_tensors=True)
    findings = diagnose(path).findings
    assert all(f.rule in RULES_BY_ID for f in findings)


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@_settings(60)
@given(which=st.integers(0, 1), data=st.data())
def test_mutated_bytes(originals, which, data):
    directory, files = originals
    original = bytearray(files[which])
    limit = _header_size(original) - 1
    edits = data.draw(st.lists(st.tuples(st.integers(0, limit), st.integers(0, 255)),
                               min_size=1, max_size=8))
    for at, value in edits:
        original[at] = value
    path = directory / "mutated.gguf"
    path.write_bytes(bytes(original))
    _check(path)


@_settings(40)
@given(which=st.integers(0, 1), cut=st.floats(0, 1))
def test_truncated_bytes(originals, which, cut):
    directory, files = originals
    original = files[which]
    path = directory / "truncated.gguf"
    path.write_bytes(original[:int(len(original) * cut)])
    _check(path)


def test_wide_integer_fields(originals):
    """Counts, dims and lengths set to extreme values in every u64 slot of the header."""
    directory, files = originals
    original = files[0]
    path = directory / "wide.gguf"
    for at in range(8, 1024, 8):
        mutated = bytearray(original)
        struct.pack_into("<Q", mutated, at, 0xFFFF_FFFF_FFFF_FFFF)
        path.write_bytes(bytes(mutated))
        _check(path)


# --- header fields of the built-in model, fed to doctor and to run's loader ---------------

def _built_in_fields() -> tuple[bytes, list[tuple[str, int, str]]]:
    """The built-in model's bytes and its numeric header fields: (what, byte offset, struct
    format) for every scalar u32 / f32 key and every tensor's dims, type and offset."""
    import moeswap
    from gguf_builders import tensor_info_offset
    from gguf import GGUFValueType

    from moeswap.formats.gguf_file import GGUFFile

    data = moeswap.DEFAULT_MODEL.read_bytes()
    gf = GGUFFile.open(moeswap.DEFAULT_MODEL)
    fields = [(item.key, item.end - 4, "<I" if item.type == GGUFValueType.UINT32 else "<f")
              for item in gf.kv.values()
              if item.type in (GGUFValueType.UINT32, GGUFValueType.FLOAT32)]
    for t in gf.tensors:
        at = tensor_info_offset(data, t.name)
        fields += [(f"{t.name} ne{i}", at + 4 + 8 * i, "<Q") for i in range(len(t.shape))]
        fields += [(f"{t.name} type", at + 4 + 8 * len(t.shape), "<I"),
                   (f"{t.name} offset", at + 8 + 8 * len(t.shape), "<Q")]
    gf.close()
    return data, fields


BUILT_IN_DATA, HEADER_FIELDS = _built_in_fields()
_INTEGERS = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 16, 17, 255, 256, 4096, 1 << 31,
                                       (1 << 32) - 1]), st.integers(0, (1 << 32) - 1))
_FLOATS = st.one_of(st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 1e30]),
                    st.floats(width=32, allow_nan=True, allow_infinity=True))


@st.composite
def _header_edit(draw):
    what, at, fmt = draw(st.sampled_from(HEADER_FIELDS))
    return what, at, fmt, draw(_FLOATS if fmt == "<f" else _INTEGERS)


@_settings(40)
@given(edits=st.lists(_header_edit(), min_size=1, max_size=3))
def test_header_fields_reach_doctor_and_the_loader_only_as_moeswap_errors(tmp_path_factory,
                                                                          edits):
    """No exception but MoeswapError from doctor or from `run`'s loader (validation first, as
    run has it), whatever numbers the header holds."""
    from moeswap.errors import MoeswapError
    from moeswap.models.loader import load_model

    data = bytearray(BUILT_IN_DATA)
    for _, at, fmt, value in edits:
        struct.pack_into(fmt, data, at, value)
    path = tmp_path_factory.mktemp("fields") / "edited.gguf"
    path.write_bytes(bytes(data))
    report = diagnose(path)
    assert all(f.rule in RULES_BY_ID for f in report.findings)
    try:
        load_model(path)
    except MoeswapError:
        return
    assert report.exit_code < 2, report.findings  # loaded: doctor saw no error either
