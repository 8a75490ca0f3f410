"""Fixtures more than one test module builds on; the run's cache folder; the skip-list check.

Every skip the run makes is printed at its end and checked against tests/expected_skips.txt: a
skip no line there allows fails the run, so a core test that quietly stops running is seen.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile
from pathlib import Path

# The reference converter where scripts/test.sh keeps it, for runs started without that script.
_REFERENCE = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moeswap"
              / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py")
if _REFERENCE.is_file():
    os.environ.setdefault("MOESWAP_LLAMA_CPP_CONVERT", str(_REFERENCE))
# Before moeswap is imported: the tokenizer cache and probe.json (which `run --plan auto` reads)
# go to a folder of this run's own, never to ~/.cache/moeswap.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="moeswap-tests-cache-")

import pytest  # noqa: E402

import tiny_models  # noqa: E402
from moeswap.gguf_tools.convert import convert  # noqa: E402

EXPECTED_SKIPS = Path(__file__).with_name("expected_skips.txt")
_UNEXPECTED = pytest.StashKey[list]()


@pytest.fixture(scope="module")
def mixtral_file(tmp_path_factory):
    """The tiny Mixtral (tiny_models: two MoE layers of four experts) converted to Q8_0."""
    folder = tmp_path_factory.mktemp("mixtral")
    tiny_models.save("mixtral", folder / "hf")
    return convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")


@pytest.fixture(scope="module")
def q8_files(tmp_path_factory):
    """(family, config overrides) -> its tiny model as a Q8_0 GGUF, made on first use."""
    made = {}

    def file(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(family)
            tiny_models.save(family, folder / "hf", **overrides)
            made[key] = convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")
        return made[key]
    return file


@pytest.fixture(scope="module")
def mixtral_q8(tmp_path_factory):
    """The tiny Mixtral with eight experts per layer, converted to Q8_0."""
    folder = tmp_path_factory.mktemp("mixtral8")
    tiny_models.save("mixtral", folder / "hf", num_local_experts=8)
    return convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")


@pytest.fixture(scope="module")
def deep_mixtral(tmp_path_factory):
    """Five MoE layers of eight experts: room for guesses up to four layers ahead."""
    folder = tmp_path_factory.mktemp("prefetch")
    tiny_models.save("mixtral", folder / "hf", num_local_experts=8, num_hidden_layers=5)
    return convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs on a CUDA GPU (skips without one)")


def expected_skip_patterns(path: Path = EXPECTED_SKIPS) -> list[str]:
    """The test-id patterns (fnmatch) of tests allowed to skip: each line's text before ' -- '."""
    lines = (line.split(" -- ")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _skips(config) -> list[tuple[str, str]]:
    """(test id, reason) of every skip so far, collection-time skips of whole modules included."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reports = reporter.stats.get("skipped", []) if reporter else []
    return [(r.nodeid, r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr))
            for r in reports]


def pytest_sessionfinish(session, exitstatus):
    patterns = expected_skip_patterns()
    unexpected = [(test, why) for test, why in _skips(session.config)
                  if not any(fnmatch.fnmatch(test, p) for p in patterns)]
    session.config.stash[_UNEXPECTED] = unexpected
    if unexpected and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skips = _skips(config)
    terminalreporter.section(f"skip list: {len(skips)} skipped")
    for test, why in skips:
        terminalreporter.line(f"{test}: {why}")
    unexpected = config.stash.get(_UNEXPECTED, [])
    if unexpected:
        terminalreporter.line(f"{len(unexpected)} skip(s) not in {EXPECTED_SKIPS.name}: the run "
                              f"fails (a core test must not skip quietly):", red=True)
        for test, why in unexpected:
            terminalreporter.line(f"  {test}: {why}", red=True)
    else:
        terminalreporter.line(f"every skip is allowed by tests/{EXPECTED_SKIPS.name}")
