"""User errors around the expert store: policy specs, foreign profiles, damaged files and caches
give one-line MoeswapErrors naming the file and the fix, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moeswap.errors import MoeswapError
from moeswap.experts import policies as p
from moeswap.routing.policy_specs import live_policy


def test_registering_the_commands_does_not_import_torch():
    code = "import sys, moeswap.cli; moeswap.cli.build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_live_policies_come_from_the_simulators_table():
    assert isinstance(live_policy("window:4", 3, 2, [1, 2], 8, "m.gguf"), p.SlidingWindow)
    assert isinstance(live_policy("admit:2", 3, 2, [1, 2], 8, "m.gguf"), p.AdmitAfter)
    with pytest.raises(MoeswapError, match="unknown policy 'mru'; choose from lru, lfu"):
        live_policy("mru", 3, 2, [1, 2], 8, "m.gguf")


def test_belady_is_refused_live_with_the_reason():
    with pytest.raises(MoeswapError, match="'belady' needs the future requests, which only a trace"):
        live_policy("belady", 3, 2, [1, 2], 8, "m.gguf")
