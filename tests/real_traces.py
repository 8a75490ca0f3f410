"""Where the tests find real routing traces.

In the repo, so in any clone: tests/data/switch-base-8 (Apache-2.0, copied with its source and
licence) and tests/data/stdlib-moe-docs (the built-in model on text it never trained on). The
Mixtral-8x7B traces have no stated licence, so the repo does not ship them: they stay in
../shared/traces (this project's workspace; MOESWAP_SHARED_TRACES points elsewhere) and their
tests skip without them, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
SWITCH = DATA / "switch-base-8" / "router-trace.v2.json"
STDLIB_DOCS = DATA / "stdlib-moe-docs" / "trace.npz"
MIXTRAL = Path(os.environ.get("MOESWAP_SHARED_TRACES",
                              Path(__file__).parents[2] / "shared" / "traces")) / "mixtral-8x7b"
needs_mixtral = pytest.mark.skipif(
    not MIXTRAL.is_dir(), reason=f"the Mixtral-8x7B traces have no stated licence, so the repo "
                                 f"does not ship them; they are only in {MIXTRAL} (this "
                                 f"project's workspace)")
