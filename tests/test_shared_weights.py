"""With the offload store, shared weights live in anonymous memory, not in the mapped file: a
model file truncated under a running process no longer faults in shared-weight compute."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

# Run in a child: a regression is a SIGBUS, which would take the test runner down with it.
CHILD = textwrap.dedent("""
    import os, sys, torch
    from moeswap.experts.build import build_store
    from moeswap.experts.settings import OffloadSettings
    from moeswap.models.loader import load_model

    path, tokens = sys.argv[1], [int(t) for t in sys.argv[2:]]
    factory = build_store(OffloadSettings(host_bytes=1 << 30, prefetch="off"))
    model = load_model(path, threads=1, expert_runner=factory)
    before = model.forward([torch.tensor(tokens)], [model.new_cache()])[0]
    os.truncate(path, 0)  # the same prompt routes to the same experts, now all in host slots
    after = model.forward([torch.tensor(tokens)], [model.new_cache()])[0]
    assert torch.equal(before, after)
    assert factory.stats()["total"]["disk_misses"] > 0
    print("same logits after the truncation")
""")


def test_a_file_truncated_under_the_store_leaves_shared_weights_computing(mixtral_file, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copy(mixtral_file, copy)
    done = subprocess.run([sys.executable, "-c", CHILD, str(copy), "3", "1", "4", "1", "5", "9"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "same logits after the truncation" in done.stdout


def test_the_tensor_log_says_where_shared_weights_live(mixtral_file):
    from moeswap.experts.build import build_store
    from moeswap.experts.settings import OffloadSettings
    from moeswap.models.loader import load_model

    lines = []
    load_model(mixtral_file, threads=1, verbose_log=lines.append,
               expert_runner=build_store(OffloadSettings(host_bytes=1 << 30)))
    shared = [line for line in lines if "_exps" not in line]
    assert shared and not any("mapped file" in line for line in shared)
    assert any("RAM (copied from the file) (computed by kernels)" in line for line in shared)
