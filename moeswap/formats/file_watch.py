"""A loaded model's files under a long-running server: changed in place, they are refused.

The weights are mapped from the file. Writing it in place (``cp new.gguf model.gguf``
truncates, then rewrites the same inode) pulls the pages out from under the mapping: reads
past the new end kill the process with SIGBUS, and rewritten pages compute nonsense. Replacing
it by rename (``mv new.gguf model.gguf``) is safe: the mapping keeps the old inode, and the
server answers from the model it loaded until it restarts.

``FileWatch`` keeps a descriptor of each file as loaded and, before each forward, compares
its size and mtime (``fstat`` of that inode, so a rename over the path is not a change) with
the ones at load time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moeswap.errors import MoeswapError


class FileWatch:
    def __init__(self, paths: list[Path]):
        self._files: list[tuple[Path, int, int, int]] = []  # path, fd, size, mtime_ns
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            stat = os.fstat(fd)
            self._files.append((path, fd, stat.st_size, stat.st_mtime_ns))

    @classmethod
    def of_source(cls, source: Any) -> "FileWatch":
        """The files a model's weights come from: a GGUF file's pieces (``GGUFFile``); none for a
        folder, whose tensors are read into memory."""
        return cls(list(getattr(source, "piece_paths", [])))

    def check(self) -> None:
        """Raise a MoeswapError when a file was changed in place since it was loaded."""
        for path, fd, size, mtime_ns in self._files:
            stat = os.fstat(fd)
            if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
                raise MoeswapError(
                    f"{path}: the model file changed on disk since it was loaded ({size} -> "
                    f"{stat.st_size} bytes); restart the server to load it. Replace a model "
                    "file by renaming the new one over it (mv new.gguf model.gguf), not by "
                    "copying onto it")

    def close(self) -> None:
        for _, fd, _, _ in self._files:
            os.close(fd)
        self._files = []
