"""Outputs that appear whole or not at all: written to a temporary file beside the output,
renamed over it only once complete, removed on failure and on SIGTERM.

An existing output is therefore never destroyed by a failed write (a full disk, a kill). The
temporary file is ``.NAME.PID.tmp`` beside ``NAME``: a later write of the same output removes
those whose process no longer runs (left by SIGKILL, which no handler sees).
"""

from __future__ import annotations

import glob
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from moeswap.errors import MoeswapError


def temp_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.{os.getpid()}.tmp")


def remove_stale_temps(out: Path) -> list[Path]:
    """Remove the temporary files of ``out`` that processes no longer running left behind."""
    removed = []
    prefix = f".{out.name}."
    for path in Path(out.parent).glob(f"{glob.escape(prefix)}*.tmp"):
        pid = path.name[len(prefix):-len(".tmp")]
        if pid.isdigit() and not _running(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM raises KeyboardInterrupt in the main thread, so that
    ``finally`` clauses remove temporary files; by default SIGTERM ends Python without them.
    Elsewhere than the main thread (no signal handlers there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def atomic_output(out: str | os.PathLike, what: str) -> Iterator[Path]:
    """A temporary path for the block to write ``what`` ("the trace") to; renamed over ``out``
    when the block ends without error, removed otherwise. ``out`` is untouched until then."""
    out = Path(out)
    remove_stale_temps(out)
    tmp = temp_path(out)
    kept = "the existing file is unchanged" if out.exists() else "nothing written"
    with terminate_as_interrupt():
        try:
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except OSError as e:
            raise MoeswapError(f"{out}: cannot write {what} ({e.strerror or e}); {kept}") from None
        except MoeswapError as e:  # the writer's own words, about the temporary name
            raise MoeswapError(f"{str(e).replace(str(tmp), str(out))}; {kept}") from None
        finally:
            tmp.unlink(missing_ok=True)
