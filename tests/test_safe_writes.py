"""Writes that never destroy (issue 23): `run --trace` and `fix` write beside the output and
rename; a failed write leaves an existing output as it was, SIGTERM removes the temporary
file, and a temporary file a killed process left is removed by the next write."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf_builders import MUTATIONS

import moeswap
from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.formats.atomic_file import atomic_output, remove_stale_temps
from moeswap.gguf_tools.fix import fix_file


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _leftovers(directory) -> list:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_failed_trace_write_keeps_the_existing_trace(tmp_path, monkeypatch, capsys):
    out = tmp_path / "trace.npz"
    out.write_bytes(b"the previous trace")

    def full_disk(f, **arrays):
        f.write(b"half a trace")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", full_disk)
    code = main(["run", str(moeswap.DEFAULT_MODEL), "-p", "def", "-n", "2", "--temp", "0",
                 "--trace", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{out}: cannot write the trace (No space left on device)" in err
    assert "the existing file is unchanged" in err
    assert out.read_bytes() == b"the previous trace"
    assert _leftovers(tmp_path) == []


def test_trace_is_written_whole(tmp_path):
    out = tmp_path / "trace.npz"
    out.write_bytes(b"old")
    assert main(["run", str(moeswap.DEFAULT_MODEL), "-p", "def", "-n", "2", "--temp", "0",
                 "--trace", str(out)]) == 0
    assert out.read_bytes()[:2] == b"PK" and _leftovers(tmp_path) == []


def test_stale_temporary_files_of_dead_processes_are_removed(tmp_path):
    out = tmp_path / "out.gguf"
    stale = tmp_path / f".out.gguf.{_dead_pid()}.tmp"
    running = tmp_path / ".out.gguf.1.tmp"  # pid 1 runs
    other = tmp_path / ".other.gguf.99999999.tmp"
    for path in (stale, running, other):
        path.write_bytes(b"x")
    assert remove_stale_temps(out) == [stale]
    assert _leftovers(tmp_path) == sorted([running.name, other.name])


def test_fix_removes_its_stale_temporary_files(tmp_path):
    source = next(m for m in MUTATIONS if m.name == "wrong_key_type_u64").build(tmp_path)
    out = tmp_path / "fixed.gguf"
    stale = tmp_path / f".fixed.gguf.{_dead_pid()}.tmp"
    stale.write_bytes(b"x" * 1000)
    fix_file(source, out)
    assert out.exists() and not stale.exists() and _leftovers(tmp_path) == []


SIGTERM_CHILD = textwrap.dedent("""
    import os, signal, sys
    from moeswap.formats.atomic_file import atomic_output
    try:
        with atomic_output(sys.argv[1], "the output") as tmp:
            tmp.write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)
            tmp.write_bytes(b"never")
    except KeyboardInterrupt:
        sys.exit(143)
""")


def test_sigterm_removes_the_temporary_file_and_keeps_the_output(tmp_path):
    out = tmp_path / "out.bin"
    out.write_bytes(b"kept")
    run = subprocess.run([sys.executable, "-c", SIGTERM_CHILD, str(out)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 143, run.stderr
    assert out.read_bytes() == b"kept" and _leftovers(tmp_path) == []


def test_a_writer_error_names_the_output_not_the_temporary_file(tmp_path):
    out = tmp_path / "out.bin"
    with pytest.raises(MoeswapError, match=f"^{out}: boom; nothing written$"):
        with atomic_output(out, "the output") as tmp:
            raise MoeswapError(f"{tmp}: boom")
    assert _leftovers(tmp_path) == [] and not out.exists()


def test_fix_under_sigterm_removes_its_temporary_file_and_keeps_the_output(tmp_path,
                                                                           monkeypatch):
    import os
    import signal

    import moeswap.gguf_tools.fix as fix

    source = next(m for m in MUTATIONS if m.name == "wrong_key_type_u64").build(tmp_path)
    out = tmp_path / "fixed.gguf"
    out.write_bytes(b"an earlier output")
    write = fix._write

    def killed_midway(gf, file, f, on_progress):
        f.write(b"part of a header")
        os.kill(os.getpid(), signal.SIGTERM)
        write(gf, file, f, on_progress)

    monkeypatch.setattr(fix, "_write", killed_midway)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        fix_file(source, out)
    assert out.read_bytes() == b"an earlier output" and _leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == handler  # put back
