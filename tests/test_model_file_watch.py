"""The server refuses to compute from a model file changed in place under it (it would SIGBUS
or compute from rewritten pages), and keeps serving when the file is replaced by rename."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

import moeswap
from moeswap.errors import MoeswapError
from moeswap.formats.file_watch import FileWatch
from moeswap.sampling import GREEDY, Sampler
from moeswap.server.batching import BatchOptions, BatchScheduler


def test_in_place_change_is_refused_and_rename_is_not(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"x" * 100)
    watch = FileWatch([path])
    watch.check()
    replacement = tmp_path / "new.gguf"
    replacement.write_bytes(b"y" * 50)
    os.replace(replacement, path)  # the watched inode is untouched
    watch.check()
    watch.close()

    watch = FileWatch([path])
    with open(path, "r+b") as f:  # what cp onto the file does: truncate, then write
        f.truncate(10)
    with pytest.raises(MoeswapError, match="changed on disk.*mv new.gguf model.gguf"):
        watch.check()
    watch.close()


def _one_request(scheduler, ids) -> tuple[list[int], str | None]:
    tokens, done, error = [], threading.Event(), []

    def on_event(event):
        if event.token is not None:
            tokens.append(event.token)
        if event.error is not None:
            error.append(event.error)
        if event.finish_reason is not None or event.error is not None:
            done.set()

    scheduler.submit(ids, max_tokens=2, sampler=Sampler(GREEDY), stop_ids=frozenset(),
                     on_event=on_event)
    assert done.wait(60)
    return tokens, error[0] if error else None


def test_scheduler_refuses_after_the_file_is_overwritten(tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(moeswap.DEFAULT_MODEL, path)
    runtime = moeswap.load(path)
    scheduler = BatchScheduler(runtime.model, BatchOptions(max_batch=2, ctx=64))
    scheduler.start()
    try:
        ids = runtime.encode("def")
        tokens, error = _one_request(scheduler, ids)
        assert len(tokens) == 2 and error is None
        os.utime(path, ns=(0, 0))  # rewritten in place: same inode, new mtime
        tokens, error = _one_request(scheduler, ids)
        assert tokens == [] and "the model file changed on disk" in error
    finally:
        scheduler.stop()
