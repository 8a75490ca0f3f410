"""Property: on mutated or truncated GGUF bytes, inspect and doctor never raise an unhandled
exception, and every failure they report is a named doctor rule."""

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
