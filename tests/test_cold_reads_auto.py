"""`--cold-reads auto|on|off` (auto the default, bare: on): auto reads experts past the page
cache only where the process's memory cgroup (a fake v1 or v2 tree) has less room than the model
file beside the host budget, and says so in one line; the store gets exactly that choice."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cgroup_memory import V1_NONE, MiB, v1_tree, v2_tree
from test_plan_auto import MODEL, charged, run, sizes  # noqa: F401 (sizes: a fixture)

from moeswap.cli import build_parser, main
from moeswap.cli.offload_args import bare_cold_reads_as_on, offload_settings
from moeswap.experts import build
from moeswap.planner import auto, cold_reads
from moeswap.planner.auto import machine_memory
from moeswap.planner.cgroup_memory import CgroupLimit, cgroup_limit
from moeswap.planner.cold_reads import choose_cold_reads

FILE_BYTES = Path(MODEL).stat().st_size  # the built-in model: one file
LIMIT = CgroupLimit(limit=1200 * MiB, free=900 * MiB, folder=Path("/cg/job"))


def test_auto_turns_on_only_where_file_and_budget_outgrow_the_cgroups_room():
    assert choose_cold_reads("auto", 700 * MiB, 2200 * MiB, LIMIT).on
    assert not choose_cold_reads("auto", 700 * MiB, 200 * MiB, LIMIT).on  # 900 MiB: both fit
    assert choose_cold_reads("auto", 700 * MiB, 200 * MiB + 1, LIMIT).on  # one byte over
    assert not choose_cold_reads("auto", 700 * MiB, 2200 * MiB, None).on  # no limit: page cache
    assert choose_cold_reads("auto", 700 * MiB, 2200 * MiB, LIMIT).note.startswith(
        "cold reads: on (--cold-reads auto): memory cgroup /cg/job has 900.00 MiB free, less than "
        "the model file's 2.15 GiB in the page cache beside the 700.00 MiB host budget")


def test_on_and_off_are_kept_whatever_the_cgroup():
    for cgroup in (LIMIT, None):
        on, off = (choose_cold_reads(mode, 700 * MiB, 2200 * MiB, cgroup) for mode in ("on", "off"))
        assert on.on and not off.on and on.note == off.note == ""


def parsed(*flags: str):
    return build_parser().parse_args(bare_cold_reads_as_on(["run", *flags])).cold_reads


def test_flag_parsing_auto_by_default_bare_is_on():
    assert parsed(MODEL, "-p", "x") == "auto"
    for mode in ("auto", "on", "off"):
        assert parsed(MODEL, "-p", "x", "--cold-reads", mode) == mode
        assert parsed(f"--cold-reads={mode}", MODEL, "-p", "x") == mode
    assert parsed(MODEL, "-p", "x", "--cold-reads") == "on"  # last
    assert parsed(MODEL, "--cold-reads", "-p", "x") == "on"  # before another flag
    # before the positional model, as scripts spelled it when the flag took no value
    args = build_parser().parse_args(bare_cold_reads_as_on(["run", "--cold-reads", MODEL, "-p", "x"]))
    assert (args.cold_reads, args.model) == ("on", MODEL)


def test_a_wrong_mode_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["run", MODEL, "-p", "x", "--cold-reads=maybe"])
    assert "argument --cold-reads: invalid choice: 'maybe'" in capsys.readouterr().err
    # spaced, it reads as a bare --cold-reads and a stray argument: refused all the same
    with pytest.raises(SystemExit):
        main(["run", MODEL, "-p", "x", "--cold-reads", "maybe"])
    err = capsys.readouterr().err
    assert "[--cold-reads [{auto,on,off}]]" in err and "unrecognized arguments: maybe" in err


def settings_in(monkeypatch, tree, *flags: str):
    """offload_settings for the built-in model under the fake cgroup ``tree`` -> (settings,
    lines said)."""
    monkeypatch.setattr(cold_reads, "cgroup_limit", lambda: cgroup_limit(*tree))
    said = []
    settings = offload_settings(build_parser().parse_args(bare_cold_reads_as_on(
        ["run", MODEL, "-p", "x", *flags])), model_path=MODEL, say=said.append)
    return settings, said


@pytest.mark.parametrize("tree_of", [
    lambda path, limit: v1_tree(path, str(limit), V1_NONE, own_rss=4 * MiB),
    lambda path, limit: v2_tree(path, str(limit), "max", own_anon=4 * MiB),
], ids=["v1", "v2"])
def test_offload_settings_get_cold_reads_only_where_they_should(tmp_path, monkeypatch, tree_of):
    host = "16MiB"  # 4 MiB of each limit below is held: the room is the limit less that
    tight = tree_of(tmp_path / "tight", 16 * MiB + FILE_BYTES + 2 * MiB)
    roomy = tree_of(tmp_path / "roomy", 16 * MiB + FILE_BYTES + 8 * MiB)
    unlimited = v2_tree(tmp_path / "none", "max", "max")

    settings, said = settings_in(monkeypatch, tight, "--host-mem", host)
    assert settings.cold_reads and len(said) == 1 and "(--cold-reads auto)" in said[0]
    for tree, flags in ((roomy, ()), (unlimited, ()), (tight, ("--cold-reads", "off"))):
        settings, said = settings_in(monkeypatch, tree, "--host-mem", host, *flags)
        assert not settings.cold_reads and said == []
    for tree in (roomy, unlimited):  # asked for: on, without a word
        settings, said = settings_in(monkeypatch, tree, "--host-mem", host, "--cold-reads")
        assert settings.cold_reads and said == []
    assert settings_in(monkeypatch, tight) == (None, [])  # no store: nothing read from disk


def test_run_plan_auto_in_a_cgroup_takes_the_same_rule(sizes, tmp_path, capsys,  # noqa: F811
                                                       monkeypatch):
    chosen = []
    monkeypatch.setattr(build, "load_options",
                        lambda settings, *rest, real=build.load_options:
                        chosen.append(settings) or real(settings, *rest))
    budget = charged(sizes) + 5 * sizes.slot_bytes
    # The plan keeps CGROUP_RESERVE back beyond its budget: 128 MiB of page cache the 23 MiB
    # built-in file fits in, so reads stay in the page cache and nothing is said.
    tree = v1_tree(tmp_path / "a", str(auto.CGROUP_RESERVE + budget), V1_NONE)
    monkeypatch.setattr(cold_reads, "cgroup_limit", lambda: cgroup_limit(*tree))
    code, _, err = run(capsys, monkeypatch, machine_memory(*tree), "--plan", "auto")
    assert code == 0 and "plan auto: memory cgroup" in err and "0 device + 5 host slots" in err
    assert chosen[-1].host_bytes == budget and not chosen[-1].cold_reads
    assert "cold reads" not in err
    # A cgroup with less room beyond the budget than the file: read past the page cache.
    monkeypatch.setattr(auto, "CGROUP_RESERVE", 1 * MiB)
    tree = v1_tree(tmp_path / "b", str(1 * MiB + budget), V1_NONE)
    monkeypatch.setattr(cold_reads, "cgroup_limit", lambda: cgroup_limit(*tree))
    code, _, err = run(capsys, monkeypatch, machine_memory(*tree), "--plan", "auto")
    assert code == 0 and "0 device + 5 host slots" in err
    assert chosen[-1].host_bytes == budget and chosen[-1].cold_reads
    assert sum("cold reads: on (--cold-reads auto): memory cgroup" in line
               for line in err.splitlines()) == 1
