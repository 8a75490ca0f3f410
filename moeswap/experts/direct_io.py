"""One model file read past the page cache: ``O_DIRECT`` where the filesystem allows it, else
``pread`` and ``posix_fadvise(DONTNEED)``.

Cold reads keep expert reads out of the page cache, which a memory cgroup charges to the
process (and reclaims page by page when the limit binds) while the budgets never count it.
``O_DIRECT`` wants the file offset, the length and the memory address aligned to the device's
block (``DIRECT_ALIGNMENT`` covers 512- and 4096-byte blocks). A piece of an expert rarely
starts on a block, so the aligned middle of a range is read straight into its target when the
target's address and the file offset agree modulo the block, and the rest goes through a small
aligned bounce buffer per reading thread (``BOUNCE_BYTES``, allocated at its first cold read).
They are not charged to ``--host-mem``: 1 MiB per reading thread and file, inside the
runtime's reserve that ``--plan auto`` keeps back (moeswap.planner.auto). Whether
``O_DIRECT`` works is found per file: the open is refused on tmpfs, and a filesystem that
accepts the flag may still refuse the reads (EINVAL); either way the file falls back to
``pread`` and drops what it read. Without ``cold`` every read is a plain ``pread`` through the
page cache.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np

DIRECT_ALIGNMENT = 4096
BOUNCE_BYTES = 1 << 20  # per reading thread, a multiple of DIRECT_ALIGNMENT


class ShortRead(Exception):
    """The file ended before ``end`` (the caller names the tensor)."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end)
        self.start, self.end = start, end


def _down(n: int) -> int:
    return n - n % DIRECT_ALIGNMENT


def _up(n: int) -> int:
    return _down(n + DIRECT_ALIGNMENT - 1)


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset`` with as many reads as it takes -> bytes read (fewer only
    at the end of the file)."""
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:  # platforms without preadv: one copy more
            chunk = os.pread(fd, len(view) - done, offset + done)
            n = len(chunk)
            view[done:done + n] = chunk
        if n == 0:
            break
        done += n
    return done


class ModelFile:
    """One file of the model, read by any number of threads at once (``pread`` keeps no
    position)."""

    def __init__(self, path: str | os.PathLike, cold: bool):
        self.path, self.cold = path, cold
        self.fd = os.open(path, os.O_RDONLY)
        self.direct_fd: int | None = None
        if cold and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        self._refused: int | None = None
        self._bounce = threading.local()

    @property
    def direct(self) -> bool:
        return self.direct_fd is not None

    def read(self, target: np.ndarray, offset: int) -> None:
        """Fill ``target`` (uint8, contiguous) with the file's bytes from ``offset``; raises
        ``ShortRead`` when the file ends first."""
        if self.direct_fd is not None:
            try:
                self._read_direct(target, offset)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._stop_direct()  # accepted at open, refused at read: this file reads cached
        got = pread_into(self.fd, memoryview(target), offset)
        if got < target.nbytes:
            raise ShortRead(offset, offset + target.nbytes)
        if self.cold and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, target.nbytes, os.POSIX_FADV_DONTNEED)

    def _read_direct(self, target: np.ndarray, offset: int) -> None:
        end = offset + target.nbytes
        middle = (_up(offset), _down(end))
        ranges = [(offset, end)]
        if (target.ctypes.data - offset) % DIRECT_ALIGNMENT == 0 and middle[0] < middle[1]:
            view = memoryview(target)[middle[0] - offset:middle[1] - offset]
            if pread_into(self.direct_fd, view, middle[0]) < len(view):
                raise ShortRead(offset, end)
            ranges = [(offset, middle[0]), (middle[1], end)]
        for start, stop in ranges:
            self._read_bounced(target[start - offset:stop - offset], start)

    def _read_bounced(self, target: np.ndarray, offset: int) -> None:
        """Aligned reads into this thread's bounce buffer, each copied out."""
        bounce = self._bounce_buffer()
        done = 0
        while done < target.nbytes:
            at = offset + done
            base = _down(at)
            want = min(_up(offset + target.nbytes) - base, bounce.nbytes)
            got = pread_into(self.direct_fd, memoryview(bounce)[:want], base)
            n = min(base + got, offset + target.nbytes) - at
            if n <= 0:
                raise ShortRead(offset, offset + target.nbytes)
            target[done:done + n] = bounce[at - base:at - base + n]
            done += n

    def _bounce_buffer(self) -> np.ndarray:
        buffer = getattr(self._bounce, "buffer", None)
        if buffer is None:
            spare = np.empty(BOUNCE_BYTES + DIRECT_ALIGNMENT, dtype=np.uint8)
            start = -spare.ctypes.data % DIRECT_ALIGNMENT
            buffer = self._bounce.buffer = spare[start:start + BOUNCE_BYTES]
        return buffer

    def _stop_direct(self) -> None:
        # closed with the file, not now: another thread may be reading through it
        if self.direct_fd is not None:
            self._refused, self.direct_fd = self.direct_fd, None

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd, self._refused):
            if fd is not None:
                os.close(fd)
        self.direct_fd = self._refused = None
