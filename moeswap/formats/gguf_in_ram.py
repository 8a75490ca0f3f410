"""A resident model's weights copied out of the mapped file into anonymous memory backed by
transparent huge pages (llama.cpp's ``--no-mmap``, plus the huge pages).

A decode step streams every resident weight once; through 4 KiB file pages that is a TLB miss
every 4 KiB, through 2 MiB pages one every 2 MiB. Measured on the 1.1 GB Mixtral-shaped Q8_0
file (docs/KERNELS.md, "Weights in RAM"): the same graphs ~12 % faster a token. The file's own
pages stay in the page cache, reclaimable; the copy is what the process holds. Where the kernel
offers no transparent huge pages (``never``), the copy is plain anonymous memory.
"""

from __future__ import annotations

import mmap
from pathlib import Path

from moeswap.errors import MoeswapError
from moeswap.formats.gguf_file import GGUFFile, TensorInfo

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_CHUNK = 64 << 20  # bytes read per call (a progress step)


def huge_pages_offered(setting: Path = THP_SETTING) -> bool:
    """Whether madvise(MADV_HUGEPAGE) can give this process huge pages ("[always]" or
    "[madvise]" selected)."""
    try:
        chosen = setting.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return False
    return chosen in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def copy_into_ram(gguf: GGUFFile) -> None:
    """Give each of the model's files an anonymous copy as its buffer (before anything binds
    its tensors): read whole, advised for huge pages where the kernel offers them."""
    for piece in gguf.piece_files:
        size = piece.path.stat().st_size
        copy = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages_offered():
            copy.madvise(mmap.MADV_HUGEPAGE)
        try:
            _read_whole(piece.path, copy, size)
        except OSError as e:
            copy.close()
            raise MoeswapError(f"{piece.path}: cannot read into RAM ({e.strerror or e}); "
                               "use --mmap to compute from the mapped file") from None
        except BaseException:
            copy.close()
            raise
        piece.buffer = copy
        piece.in_ram = True


def release(gguf: GGUFFile, info: TensorInfo) -> bool:
    """Give back the RAM copy's pages wholly inside a tensor that is no longer read (ggml holds
    a repacked copy of it): the copy would hold the tensor twice -> whether any went back (a
    mapped file: none, its pages are the page cache's)."""
    piece = gguf.piece_of(info)
    if not getattr(piece, "in_ram", False):
        return False
    start = -(-info.data_start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = info.data_end // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        piece.buffer.madvise(mmap.MADV_DONTNEED, start, end - start)
    return end > start


def _read_whole(path: Path, copy: mmap.mmap, size: int) -> None:
    with open(path, "rb") as f, memoryview(copy) as view:
        for start in range(0, size, _CHUNK):
            if f.readinto(view[start:start + _CHUNK]) != min(_CHUNK, size - start):
                raise MoeswapError(f"{path}: the file shrank while it was read into RAM; "
                                   "load it again")
