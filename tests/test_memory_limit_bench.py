"""`moeswap bench --memory-limit`: cgroups made and removed (on fake v1 and v2 trees), their
figures read, rows skipped where no cgroup can be made, and the floor's arithmetic."""

from __future__ import annotations

import json

import pytest

import moeswap
from moeswap.bench.cgroup import MemoryCgroup, NoCgroup
from moeswap.bench.memory_limits import _forwards_on, floor_row, run_limits
from moeswap.experts.cost import Rates

MiB = 1 << 20


def fake_tree(tmp_path, version: str):
    root = tmp_path / "sys"
    if version == "v1":
        (root / "memory" / "box").mkdir(parents=True)
        (tmp_path / "cgroup").write_text("4:memory:/box\n0::/box\n")
    else:
        (root / "box").mkdir(parents=True)
        (root / "cgroup.controllers").write_text("memory")
        (tmp_path / "cgroup").write_text("0::/box\n")
    return root, tmp_path / "cgroup"


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroup_is_made_limited_read_and_removed(tmp_path, version):
    root, own = fake_tree(tmp_path, version)
    cgroup = MemoryCgroup.create(700 * MiB, "run", root, own)
    limit = "memory.limit_in_bytes" if version == "v1" else "memory.max"
    assert (cgroup.folder / limit).read_text() == str(700 * MiB)
    assert cgroup.folder.parent.name == "box"
    if version == "v1":
        (cgroup.folder / "memory.max_usage_in_bytes").write_text("123\n")
        (cgroup.folder / "memory.failcnt").write_text("45\n")
        (cgroup.folder / "memory.oom_control").write_text("oom_kill_disable 0\noom_kill 1\n")
    else:
        (cgroup.folder / "memory.peak").write_text("123\n")
        (cgroup.folder / "memory.events").write_text("low 0\nhigh 0\nmax 45\noom 1\noom_kill 1\n")
    assert cgroup.figures() == {"cgroup_peak_bytes": 123, "cgroup_failcnt": 45,
                                "cgroup_oom_kills": 1}
    cgroup.remove()
    assert not cgroup.folder.exists()


def test_no_memory_controller_is_said(tmp_path):
    (tmp_path / "cgroup").write_text("0::/box\n")  # v2 line, but no cgroup filesystem
    with pytest.raises(NoCgroup, match="no memory cgroup for this process"):
        MemoryCgroup.create(MiB, "run", tmp_path / "sys", tmp_path / "cgroup")


def test_the_floor_is_the_slower_of_reading_and_computing():
    rates = Rates(disk_read=2e9, link=1e10, host_compute=40e9, device_compute=1e11)
    read_bound = floor_row({"read_bytes_per_token": 245e6, "decode_tok_s": 2.88}, 670e6, rates)
    assert read_bound["floor_tok_s"] == pytest.approx(2e9 / 245e6)
    assert read_bound["of_floor"] == pytest.approx(2.88 / (2e9 / 245e6))
    compute_bound = floor_row({"read_bytes_per_token": 0, "decode_tok_s": 30}, 670e6, rates)
    assert compute_bound["floor_tok_s"] == pytest.approx(40e9 / 670e6)
    assert "disk_busy" not in compute_bound  # no store: nothing said of the disk


def test_the_disk_busy_share_is_the_readers_busy_time_over_decode_time():
    rates = Rates(disk_read=2e9, link=1e10, host_compute=40e9, device_compute=1e11)
    run = {"read_bytes_per_token": 245e6, "decode_tok_s": 4.0, "decode_tokens": 32,
           "counts": {"disk_busy_seconds": 6.0, "disk_read_bytes": 9e9}}
    row = floor_row(run, 670e6, rates)
    assert row["disk_busy"] == pytest.approx(6.0 / 8.0)  # 32 tokens at 4/s: 8 s of decode
    assert row["busy_read_rate"] == pytest.approx(1.5e9)
    assert row["floor_read_rate"] == 2e9  # the probe's, faster
    run["counts"]["disk_read_bytes"] = 18e9  # 3 GB/s while busy: faster than the probe
    row = floor_row(run, 670e6, rates)
    assert row["floor_read_rate"] == pytest.approx(3e9)
    assert row["floor_tok_s"] == pytest.approx(3e9 / 245e6)  # the disk allowed that rate


def test_guesses_read_in_vain_are_not_part_of_the_floor():
    rates = Rates(disk_read=2e9, link=1e10, host_compute=40e9, device_compute=1e11)
    run = {"read_bytes_per_token": 245e6, "decode_tok_s": 4.0, "decode_tokens": 32,
           "counts": {"guess_wasted_bytes": 32 * 45e6}}
    assert floor_row(run, 670e6, rates)["floor_tok_s"] == pytest.approx(2e9 / 200e6)


def test_the_share_of_forwards_prefetch_ran_in_is_reported():
    assert _forwards_on({"prefetch_forwards_on": 24, "prefetch_forwards_off": 8}) == "75%"
    assert _forwards_on({"disk_misses": 3}) == "-"  # prefetch off: no throttle


def test_runs_in_each_limit_and_skips_where_no_cgroup_can_be_made(tmp_path):
    root, own = fake_tree(tmp_path, "v1")
    model = str(moeswap.DEFAULT_MODEL)
    rates = iter([1e9, 3e9])  # cold reads measured before and after the run
    body, text = run_limits(model, [900 * MiB], 1, [5, 6, 7, 8], 2, False, None, "off",
                            tmp_path / "out", 300, say=lambda _: None, cgroup_root=root,
                            self_cgroup=own, disk_rate=lambda: next(rates))
    [row] = body["rows"]
    assert row["status"] == "ok", row
    assert row["engine"] == "moeswap" and row["decode_tokens"] == 2
    assert row["disk_read_beside"] == [1e9, 3e9]
    read, computed = row["read_bytes_per_token"], body["computed_bytes_per_token"]
    cached = body["rates"]["disk_read"], body["rates"]["host_compute"]
    # the faster of the two rates beside the run: the stricter floor
    assert row["floor_tok_s"] == pytest.approx(1 / max(read / 3e9, computed / cached[1]))
    assert row["of_floor_cached_probe"] == pytest.approx(
        max(read / cached[0], computed / cached[1]) * row["decode_tok_s"])
    assert "| 900 | moeswap |" in text and "| 3.00 |" in text and text.count(" - |\n") == 1
    assert list((root / "memory" / "box").iterdir()) == []  # its cgroup removed
    json.dumps(body)
    none, text = run_limits(model, [900 * MiB], 1, [5, 6], 1, True, None, "off",
                            tmp_path / "out", 300, say=lambda _: None,
                            cgroup_root=tmp_path / "nothing", self_cgroup=own)
    assert none["rows"] == [] and "no memory cgroup can be made here" in text
