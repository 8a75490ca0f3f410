"""Container-aware budgets: the process's memory cgroup (v1 and v2, read from a fake cgroup
filesystem) caps the machine's memory that `--plan auto` and `moeswap plan` plan for."""

from __future__ import annotations

import json

import moeswap
from moeswap.cli import main
from moeswap.experts.cost import Rates
from moeswap.planner import auto
from moeswap.planner.auto import (
    CGROUP_RESERVE,
    HOST_RESERVE,
    Machine,
    auto_plan,
    machine_memory,
)
from moeswap.planner.cgroup_memory import cgroup_limit, own_cgroup
from moeswap.planner.rates import PlanRates

MiB = 1 << 20
V1_NONE = "9223372036854771712"


def write(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def v1_tree(tmp_path, own_limit: str, parent_limit: str, own_rss: int = 0, parent_rss: int = 0):
    """/proc/self/cgroup names memory:/box/job; limits at /box/job, /box and the root."""
    root = tmp_path / "sys"
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup").write_text("5:cpu,cpuacct:/box/job\n4:memory:/box/job\n0::/box/job\n")
    write(root / "memory", memory_limit_in_bytes=V1_NONE)
    write(root / "memory" / "box", memory_limit_in_bytes=parent_limit,
          memory_stat=f"rss 0\ntotal_rss {parent_rss}\n")
    write(root / "memory" / "box" / "job", memory_limit_in_bytes=own_limit,
          memory_stat=f"cache 5\nrss {own_rss}\ntotal_rss {own_rss}\n")
    return root, tmp_path / "cgroup"


def v2_tree(tmp_path, own_max: str, parent_max: str, own_anon: int = 0):
    root = tmp_path / "sys"
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup").write_text("0::/box/job\n")
    write(root, cgroup_controllers="cpu memory")
    write(root / "box", memory_max=parent_max, memory_stat="anon 0\nfile 9\n")
    write(root / "box" / "job", memory_max=own_max, memory_stat=f"anon {own_anon}\nfile 7\n")
    return root, tmp_path / "cgroup"


def test_v1_takes_the_tightest_level_less_its_anonymous_memory(tmp_path):
    root, own = v1_tree(tmp_path, str(1200 * MiB), str(4096 * MiB), own_rss=300 * MiB)
    assert own_cgroup(root, own) == ("v1", root / "memory", root / "memory" / "box" / "job")
    found = cgroup_limit(root, own)
    assert (found.limit, found.free, found.folder) == (1200 * MiB, 900 * MiB,
                                                       root / "memory" / "box" / "job")


def test_an_ancestor_with_less_room_binds(tmp_path):
    # the job may use 2 GiB, but its parent's 3 GiB are mostly held by siblings
    root, own = v1_tree(tmp_path, str(2048 * MiB), str(3072 * MiB), parent_rss=2560 * MiB)
    found = cgroup_limit(root, own)
    assert (found.limit, found.free, found.folder) == (2048 * MiB, 512 * MiB, root / "memory" / "box")


def test_v2_reads_memory_max_up_the_path(tmp_path):
    root, own = v2_tree(tmp_path, "max", str(1024 * MiB))
    found = cgroup_limit(root, own)
    assert (found.limit, found.free, found.folder) == (1024 * MiB, 1024 * MiB, root / "box")
    root, own = v2_tree(tmp_path / "b", str(800 * MiB), "max", own_anon=100 * MiB)
    assert cgroup_limit(root, own).free == 700 * MiB


def test_no_limit_or_no_cgroup_filesystem_is_none(tmp_path):
    assert cgroup_limit(*v2_tree(tmp_path, "max", "max")) is None
    assert cgroup_limit(*v1_tree(tmp_path / "b", V1_NONE, V1_NONE)) is None
    assert cgroup_limit(tmp_path / "nothing", tmp_path / "no-such-file") is None


def test_machine_memory_is_capped_by_the_cgroup(tmp_path):
    root, own = v1_tree(tmp_path, str(1200 * MiB), V1_NONE, own_rss=300 * MiB)
    machine = machine_memory(root, own)
    assert machine.total_ram == 1200 * MiB and machine.free_ram == 900 * MiB
    assert machine.reserve == CGROUP_RESERVE and machine.cgroup.endswith("box/job")
    free = machine_memory(*v2_tree(tmp_path / "b", "max", "max"))
    assert free.cgroup == "" and free.reserve == HOST_RESERVE and free.total_ram > 1200 * MiB


def test_plan_auto_budgets_from_the_cgroup(monkeypatch):
    machine = Machine(total_ram=1200 * MiB, free_ram=900 * MiB, reserve=CGROUP_RESERVE,
                      cgroup="/sys/fs/cgroup/memory/box/job")
    rates = PlanRates(Rates(disk_read=1e9, link=1e10, host_compute=1e10, device_compute=1e11),
                      "test")
    planned = auto_plan(str(moeswap.DEFAULT_MODEL), 64, machine, rates, step_tokens=16)
    assert planned.plan.budget.host_bytes == 900 * MiB - CGROUP_RESERVE
    assert planned.describe()[0].startswith("plan auto: memory cgroup /sys/fs/cgroup/memory/box/"
                                            "job 900.00 MiB free of 1.17 GiB")


def test_moeswap_plan_without_host_mem_plans_for_the_cgroup(monkeypatch, capsys):
    machine = Machine(total_ram=1200 * MiB, free_ram=900 * MiB, reserve=CGROUP_RESERVE,
                      cgroup="/sys/fs/cgroup/memory/box/job")
    monkeypatch.setattr(auto, "machine_memory", lambda: machine)
    assert main(["plan", str(moeswap.DEFAULT_MODEL), "-c", "256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"]["host_bytes"] == 900 * MiB - CGROUP_RESERVE
