"""`moeswap bench --suite NAME`: each suite's smallest size runs on a tiny model, in the bench's
workers, and writes report.json and report.md; a suite's failed check is exit status 1; an
unknown suite is a one-line error. The measurements themselves are not timed here."""

from __future__ import annotations

import json

import pytest

import tiny_models
from moeswap.cli import main
from moeswap.gguf_tools.convert import convert


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("suites")
    tiny_models.save("mixtral", folder / "hf", num_local_experts=8)
    return convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")


def suite(out, name, *flags, code=0) -> dict:
    assert main(["bench", "-o", str(out), "--suite", name, *flags]) == code
    report = json.loads((out / "report.json").read_text())
    assert report["suite"] == name and report["machine"]["cores"]
    assert (out / "report.md").read_text().startswith("Command: ")
    return report


def test_unknown_suite_is_one_line_error(tmp_path, capsys):
    assert main(["bench", "--suite", "nope", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown suite 'nope'" in err and "decode" in err
    assert not (tmp_path / "report.json").exists()


def test_a_suite_needs_an_output_folder(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "decode", "--size", "smoke"])
    assert "-o/--output" in capsys.readouterr().err


def test_decode_suite_on_the_generated_model(tmp_path):
    report = suite(tmp_path / "out", "decode", "--models", "mixtral", "--size", "smoke",
                   "--engines", "moeswap", "--threads", "1", "--work-dir", str(tmp_path / "gen"))
    (row,) = report["results"]
    assert row["status"] == "ok", row
    assert row["engine"] == "moeswap" and len(row["outputs"][0]) == 4
    assert row["prompt_tokens"] == 8 and row["decode_tokens"] == 3
    assert list((tmp_path / "gen").glob("mixtral-shaped-*.gguf"))  # written once, kept
    assert "| moeswap |" in (tmp_path / "out" / "report.md").read_text()


def test_offload_suite_rss_check_and_table(tiny_gguf, tmp_path):
    out = tmp_path / "rss"
    code = main(["bench", "--suite", "offload", "rss", "--model", str(tiny_gguf), "-o", str(out),
                 "--prompt-tokens", "4", "--gen-tokens", "2"])
    report = json.loads((out / "report.json").read_text())
    r = report["result"]
    # on a model this small the interpreter's own noise may exceed the budget: the verdict,
    # the exit status and the markdown must agree with the figures either way
    assert report["passed"] == (r["rss_anon_growth"] <= 1.10 * r["host_budget"])
    assert code == (0 if report["passed"] else 1)
    assert ("PASS" if report["passed"] else "FAIL") in (out / "report.md").read_text()
    assert r["disk_mib"] > 0 and r["hit_rate"] is not None
    report = suite(tmp_path / "table", "offload", "table", "--model", str(tiny_gguf),
                   "--policies", "lru", "--prompt-tokens", "4", "--gen-tokens", "2")
    shares = [r["experts_share"] for r in report["results"]]
    assert shares == [0.0, 0.10, 0.25, 0.50, 1.0]
    hits = [r["hit_rate"] for r in report["results"]]
    assert hits[-1] >= hits[0]  # every expert fits: nothing misses after the first reads


def test_prefetch_suite_table_and_stress(tiny_gguf, tmp_path):
    report = suite(tmp_path / "table", "prefetch", "table", "--model", str(tiny_gguf),
                   "--tokens", "3", "--repeats", "1", "--settings", "off", "depth 2 held on",
                   "--threads", "1")
    assert list(report["runs"]) == ["off", "depth 2 held on"]
    held = report["runs"]["depth 2 held on"][0]
    assert held["tokens"] == report["runs"]["off"][0]["tokens"] and "reads" in held
    assert "| depth 2 held on | " in (tmp_path / "table" / "report.md").read_text()
    report = suite(tmp_path / "stress", "prefetch", "stress", "--model", str(tiny_gguf),
                   "--steps", "64", "--threads", "1")
    assert report["passed"] is True and set(report["runs"]) == {"off", "both", "both held on"}


def test_kernels_suite_smoke(tmp_path):
    report = suite(tmp_path, "kernels", "--size", "smoke", "--types", "Q8_0,Q4_K",
                   "--threads", "1", "--repeats", "1")
    assert report["shape"] == [256, 256] and [t["type"] for t in report["types"]] == ["Q8_0", "Q4_K"]
    cell = report["types"][0]["tokens"]["1"]
    assert cell["gbs"] > 0 and cell["nmse_vs_float64"] < 1e-2
    assert report["machine"]["cores"]  # the report's header, not the kernels' own fields


def test_kernels_suite_refuses_an_unknown_type(tmp_path, capsys):
    assert main(["bench", "--suite", "kernels", "--types", "Q8_0,Q9_9", "-o", str(tmp_path)]) == 2
    assert "no kernel for Q9_9" in capsys.readouterr().err


def test_server_suite_batched_and_one_at_a_time(tmp_path):
    out = tmp_path / "server"
    code = main(["bench", "-o", str(out), "--suite", "server", "--requests", "4",
                 "--concurrency", "2", "--max-tokens", "4", "--max-batch", "2", "--ctx", "64",
                 "--step-tokens", "32", "--host-mem", "16MiB", "--serve-args", "--threads 1"])
    report = json.loads((out / "report.json").read_text())
    assert report["suite"] == "server" and report["serve_flags"][-2:] == ["--threads", "1"]
    batched, single = report["modes"]["batched"], report["modes"]["one at a time"]
    assert (batched["max_batch"], single["max_batch"]) == (2, 1)
    # the same room for experts: one request a step is charged less, so its budget is smaller
    assert batched["host_mem"] == 16 * 2**20 > single["host_mem"] > 0
    for mode in (batched, single):
        assert mode["errors"] == [] and len(mode["latencies"]) == 4
        assert 0 < mode["tokens"] <= 16 and mode["wall"] > 0
        assert 0 < mode["baseline"] <= mode["peak"]
        assert mode["disk_bytes"] > 0 and 0 <= mode["hit_rate"] <= 1
    assert report["speedup"] > 0
    over = [n for n, m in report["modes"].items() if m["anon_growth"] > m["host_mem"]]
    assert report["over_budget"] == over and report["passed"] == (not over)
    assert code == (0 if report["passed"] else 1)
    text = (out / "report.md").read_text()
    assert "| batched (--max-batch 2) | 0 |" in text and "one at a time (--max-batch 1)" in text


def test_server_suite_refuses_flags_it_sets_itself(tmp_path, capsys):
    assert main(["bench", "-o", str(tmp_path), "--suite", "server",
                 "--serve-args", "--threads 1 --host-mem=1GiB"]) == 2
    assert "--serve-args may not set --host-mem=1GiB" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_recorder_suite_on_a_tiny_generated_model(tmp_path, capsys):
    report = suite(tmp_path / "out", "recorder", "--n-layer", "2", "--n-embd", "64",
                   "--prompt-tokens", "4", "--gen-tokens", "2", "--repeats", "3",
                   "--threads", "1", "--work-dir", str(tmp_path / "gen"))
    variants = report["variants"]
    assert list(variants) == ["off", "on", "on+probs"]
    for name, row in variants.items():
        assert row["same_tokens_as_off"] is True  # recording never changes the output
        assert len(row["ms_per_token_each_repeat"]) == 3 and row["median_ms_per_token"] > 0
        assert (row["isolated_us_per_token"] > 0) == (name != "off")
    assert variants["off"]["cost_ratio_of_medians"] == 0
    assert report["trace_tokens"] == 4 + 2  # the last run: prompt, then two decode steps
    assert list((tmp_path / "gen").glob("recorder-mixtral-q8_0-2x64x224x8.gguf"))
    assert "| on+probs | " in (tmp_path / "out" / "report.md").read_text()
    assert main(["bench", "-o", str(tmp_path / "bad"), "--suite", "recorder",
                 "--n-embd", "100"]) == 2
    assert "--n-embd must be a multiple of 64" in capsys.readouterr().err
