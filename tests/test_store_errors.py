"""User errors around the expert store: policy specs, foreign profiles, damaged files and caches
give one-line MoeswapErrors naming the file and the fix, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moeswap.errors import MoeswapError
from moeswap.routing import policies as p
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


def save_profile(path, layers: list[int], n_experts: int, hot: list[tuple[int, int]]) -> str:
    from moeswap.routing.profile import Profile

    table = p.ReuseTable(age_edges=(1, 1 << 30), window=2, expected_gap=((1.0,) * 3,) * 2)
    Profile("tiny", "x", layers, n_experts, 2, len(hot), hot, [[1] * n_experts] * len(layers),
            table, "test").save(path)
    return str(path)


@pytest.mark.parametrize("kind", ["pinned", "learned"])
def test_a_foreign_profile_is_refused_live_naming_the_file(tmp_path, kind):
    fewer = save_profile(tmp_path / "fewer.json", [1, 2], 4, [(1, 3)])
    with pytest.raises(MoeswapError, match=rf"^{fewer}: profile is for layers \[1, 2\] with 4 "
                                           r"experts, m.gguf has \[1, 2\] with 8"):
        live_policy(f"{kind}:{fewer}", 3, 2, [1, 2], 8, "m.gguf")
    other_layers = save_profile(tmp_path / "layers.json", [0, 1, 2], 8, [(2, 7)])
    with pytest.raises(MoeswapError, match=rf"^{other_layers}: profile is for layers \[0, 1, 2\]"):
        live_policy(f"{kind}:{other_layers}", 3, 2, [1, 2], 8, "m.gguf")


def test_a_profile_whose_hot_set_lies_outside_its_model_is_damaged(tmp_path):
    bad = save_profile(tmp_path / "bad.json", [1, 2], 8, [(0, 8)])
    with pytest.raises(MoeswapError, match=rf"^{bad}: damaged profile \(hot expert \(0, 8\)"):
        live_policy(f"pinned:{bad}", 3, 2, [1, 2], 8, "m.gguf")


def test_the_planner_checks_profiles_with_the_same_method(tmp_path):
    from types import SimpleNamespace

    from moeswap.planner.placement import check_profile
    from moeswap.routing.profile import Profile

    profile = Profile.load(save_profile(tmp_path / "p.json", [1, 2], 4, [(1, 3)]))
    sizes = SimpleNamespace(moe_layers=[1, 2, 3], n_expert=4, path="m.gguf")
    with pytest.raises(MoeswapError, match=r"p.json: profile is for layers \[1, 2\] with 4 "
                                           r"experts, m.gguf has \[1, 2, 3\] with 4"):
        check_profile(sizes, profile)
    check_profile(SimpleNamespace(moe_layers=[1, 2], n_expert=4, path="m.gguf"), profile)


def cut_inside_last_expert_tensor(source, target):
    """A copy of ``source`` ending half-way through its last routed-expert tensor -> its name."""
    from moeswap.formats.gguf_file import GGUFFile

    last = max((t for t in GGUFFile.open(source).tensors if "_exps" in t.name),
               key=lambda t: t.data_end)
    target.write_bytes(source.read_bytes()[:last.data_start + last.n_bytes // 2])
    return last


def test_a_truncated_model_is_refused_before_any_expert_is_read(mixtral_file, tmp_path):
    from moeswap.experts.store import ExpertStore
    from moeswap.experts.settings import OffloadSettings
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.quant import CpuKernels

    cut = tmp_path / "cut.gguf"
    last = cut_inside_last_expert_tensor(mixtral_file, cut)
    gguf = GGUFFile.open(cut)
    with pytest.raises(MoeswapError, match=rf"^{cut}: the file ends before bytes "
                                           rf"{last.data_start}-{last.data_end} of tensor "
                                           rf"'{last.name}'; it is truncated: download"):
        ExpertStore(gguf, CpuKernels(1), config_from_gguf(gguf).moe_layers, "silu",
                    OffloadSettings(host_bytes=1 << 30))


def test_a_read_past_the_end_names_the_file_tensor_and_bytes(mixtral_file, tmp_path):
    import numpy as np

    from moeswap.experts.tiers import DiskReader
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.models.quant_experts import ExpertLayout

    cut = tmp_path / "cut.gguf"
    last = cut_inside_last_expert_tensor(mixtral_file, cut)
    block = int(last.name.split(".")[1])
    layout = ExpertLayout.from_file(GGUFFile.open(mixtral_file), block)
    part = next(q for q in layout.parts if q.name == last.name)
    expert = layout.n_experts - 1
    start = part.data_start + expert * part.expert_bytes
    reader = DiskReader([cut])
    with pytest.raises(MoeswapError, match=rf"^{cut}: the file ends before bytes {start}-"
                                           rf"{start + part.expert_bytes} of tensor '{last.name}'"):
        reader.read_expert(layout, expert, np.empty(layout.expert_bytes * 2, dtype=np.uint8))
    reader.close()


RATES = {"disk_read": 1e9, "link": 2e9, "host_compute": 3e9, "device_compute": 4e9}


@pytest.mark.parametrize("text, why", [
    ("{not json", "not JSON"),
    (json.dumps({"h threads=all": {**RATES, "extra": 1.0}}), "does not hold exactly"),
    (json.dumps({"h threads=all": {"disk_read": 1e9}}), "does not hold exactly"),
    (json.dumps({"h threads=all": {**RATES, "link": "fast"}}), "not a positive number"),
    (json.dumps([1, 2]), "not a JSON object"),
])
def test_a_damaged_probe_cache_names_the_file_and_the_refresh(tmp_path, text, why):
    from moeswap.planner.probe import cached_rates, read_cache
    from moeswap.planner.rates import plan_rates

    cache = tmp_path / "probe.json"
    cache.write_text(text)
    expected = rf"^{cache}: damaged or stale probe cache \(.*{why}.*`moeswap probe --refresh`$"
    for read in (lambda: cached_rates(2, cache), lambda: read_cache(cache),
                 lambda: plan_rates({}, cache)):
        with pytest.raises(MoeswapError, match=expected):
            read()


def test_refresh_replaces_a_damaged_probe_cache(tmp_path, monkeypatch):
    from moeswap.planner import probe
    from moeswap.experts.cost import Rates

    monkeypatch.setattr(probe, "probe", lambda threads, folder, on_step: Rates(**RATES))
    monkeypatch.setattr(probe.platform, "node", lambda: "box")
    cache = tmp_path / "probe.json"
    cache.write_text("{not json")
    assert probe.cached_rates(2, cache, refresh=True) == Rates(**RATES)
    assert probe.read_cache(cache) == {("box", "2"): Rates(**RATES)}


def test_the_planner_reads_this_hosts_rates_through_read_cache(tmp_path, monkeypatch):
    from moeswap.planner import probe
    from moeswap.experts.cost import Rates
    from moeswap.planner import rates

    monkeypatch.setattr(rates.platform, "node", lambda: "box")
    cache = tmp_path / "probe.json"
    faster = {**RATES, "disk_read": 9e9}
    cache.write_text(json.dumps({"other threads=all": faster, "box threads=2": RATES,
                                 "box threads=all": faster}))
    assert rates.probe_cache_rates(cache) == Rates(**faster)
    cache.write_text(json.dumps({"other threads=all": faster, "box threads=2": RATES}))
    assert rates.probe_cache_rates(cache) == Rates(**RATES)
    assert rates.probe_cache_rates(tmp_path / "none.json") is None
    assert probe.read_cache(tmp_path / "none.json") == {}
