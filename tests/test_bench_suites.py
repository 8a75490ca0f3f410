"""`moeswap bench --suite NAME`: each suite's smallest size runs on a tiny model, in the bench's
workers, and writes report.json and report.md; a suite's failed check is exit status 1; an
unknown suite is a one-line error. The measurements themselves are not timed here."""

from __future__ import annotations

import json

import pytest

from moeswap.cli import main


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
                   "--engines", "moeswap", "--threads", "1", "--work-dir", str(tmp_path / "gen"),
                   "--rounds", "3")
    (row,) = report["results"]
    assert row["status"] == "ok", row
    assert row["engine"] == "moeswap" and len(row["outputs"][0]) == 4
    assert row["prompt_tokens"] == 8 and row["decode_tokens"] == 3
    assert report["rounds"] == 3 and len(row["rounds"]) == 3  # each run kept, the median shown
    for key in ("prompt_tok_s", "decode_tok_s"):
        assert row[key] == sorted(r[key] for r in row["rounds"])[1]
    assert list((tmp_path / "gen").glob("mixtral-shaped-*.gguf"))  # written once, kept
    assert "| moeswap |" in (tmp_path / "out" / "report.md").read_text()


def test_offload_suite_rss_check_and_table(mixtral_q8, tmp_path):
    out = tmp_path / "rss"
    code = main(["bench", "--suite", "offload", "rss", "--model", str(mixtral_q8), "-o", str(out),
                 "--prompt-tokens", "4", "--gen-tokens", "2"])
    report = json.loads((out / "report.json").read_text())
    r = report["result"]
    # on a model this small the interpreter's own noise may exceed the budget: the verdict,
    # the exit status and the markdown must agree with the figures either way
    assert report["passed"] == (r["rss_anon_growth"] <= 1.10 * r["host_budget"])
    assert code == (0 if report["passed"] else 1)
    assert ("PASS" if report["passed"] else "FAIL") in (out / "report.md").read_text()
    assert r["disk_mib"] > 0 and r["hit_rate"] is not None
    report = suite(tmp_path / "table", "offload", "table", "--model", str(mixtral_q8),
                   "--policies", "lru", "--prompt-tokens", "4", "--gen-tokens", "2")
    shares = [r["experts_share"] for r in report["results"]]
    assert shares == [0.0, 0.10, 0.25, 0.50, 1.0]
    hits = [r["hit_rate"] for r in report["results"]]
    assert hits[-1] >= hits[0]  # every expert fits: nothing misses after the first reads


def test_prefetch_suite_table_and_stress(mixtral_q8, tmp_path):
    report = suite(tmp_path / "table", "prefetch", "table", "--model", str(mixtral_q8),
                   "--tokens", "3", "--repeats", "1", "--settings", "off", "depth 2 held on",
                   "--threads", "1")
    assert list(report["runs"]) == ["off", "depth 2 held on"]
    held = report["runs"]["depth 2 held on"][0]
    assert held["tokens"] == report["runs"]["off"][0]["tokens"] and "reads" in held
    assert "| depth 2 held on | " in (tmp_path / "table" / "report.md").read_text()
    report = suite(tmp_path / "stress", "prefetch", "stress", "--model", str(mixtral_q8),
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


def test_trained_suite_profile(mixtral_q8, tmp_path):
    report = suite(tmp_path, "trained", "profile", "--model", str(mixtral_q8), "--windows", "2",
                   "--length", "8")
    profile = tmp_path / "train.profile.json"
    assert report["profile"] == str(profile.resolve()) and report["tokens"] == 16
    assert json.loads(profile.read_text())["reuse"]["window"] == report["reuse_window"]
    assert f"--policies learned:{profile.resolve()}" in (tmp_path / "report.md").read_text()


def test_trained_suite_table(mixtral_q8, tmp_path):
    report = suite(tmp_path, "trained", "table", "--model", str(mixtral_q8), "--windows", "1",
                   "--length", "8", "--policies", "lru")
    rows = report["results"]
    assert [r["experts_share"] for r in rows] == [0.0, 0.10, 0.25, 0.50, 1.0]
    budgets = [r["host_budget"] for r in rows]
    assert budgets == sorted(budgets) and budgets[0] < budgets[1]  # 10 %: a slot more
    assert rows[0]["hit_rate"] == 0 and rows[0]["disk_bytes"] > rows[-1]["disk_bytes"]
    assert report["tokens"] == 8 and all(r["tokens_per_s"] > 0 for r in rows)
    assert "| lru | 100% | " in (tmp_path / "report.md").read_text()


def test_trained_suite_threshold(mixtral_q8, tmp_path):
    report = suite(tmp_path, "trained", "threshold", "--model", str(mixtral_q8), "--windows", "1",
                   "--length", "8", "--thresholds", "0", "0.5")
    off, half = report["results"]
    picks = report["picks_per_token"] * report["tokens"]
    assert picks == 2 * 2 * 8 and report["resident_perplexity"] > 1  # top-2 in 2 layers
    # nothing dropped: the store computes what the resident model does
    assert off["threshold_drops"] == 0 and off["kl"] < 1e-9
    assert off["perplexity"] == pytest.approx(report["resident_perplexity"])
    # top-2 weights sum to 1: at most one pick of each pair is under 0.5
    assert 0 < half["threshold_drops"] <= picks / 2 and half["kl"] > 0
    assert "| off (resident) | 0 | " in (tmp_path / "report.md").read_text()


def test_trained_suite_lowbit(mixtral_q8, tmp_path):
    report = suite(tmp_path, "trained", "lowbit", "--model", str(mixtral_q8), "--windows", "1",
                   "--length", "8")
    rows = {(r["lowbit"], r["policy"], r["share"]): r for r in report["results"]}
    assert len(rows) == 7
    for type_name in ("q4_k", "q6_k"):  # 64-value rows: no 256-value blocks
        assert "not a multiple of its 256-value blocks" in rows[type_name, "lru", 0.0]["refused"]
    for type_name in ("q4_0", "q5_0"):  # no host slots: every request a copy's
        row = rows[type_name, "lru", 0.0]
        assert row["lowbit_fires"] == row["requests"] > 0 and row["kl"] > 0
    assert rows["q4_0", "lru", 0.0]["lowbit_held_bytes"] < rows["q5_0", "lru", 0.0]["lowbit_held_bytes"]
    admit = rows["q4_0", "admit:2", 0.25]
    assert 0 < admit["lowbit_fires"] < admit["requests"]
    text = (tmp_path / "report.md").read_text()
    assert "| q5_0 | lru | 0% | " in text and "q6_k (lru, 0%): refused: " in text


def tiny_traces(folder):
    """The real traces' layout with a few random tokens: Mixtral-style JSON lines (2 layers,
    top-2 of 8, 2 problems each) and a Switch-style trace of 10 prompts (2 layers, top-1)."""
    import numpy as np

    rng = np.random.default_rng(0)
    (folder / "mixtral-8x7b").mkdir(parents=True)
    for name in ("gsm8k", "humaneval"):
        rows = [{"dataset": name, "problem_id": p, "layer": layer, "token_idx": t,
                 "experts": [int(e) for e in rng.choice(8, 2, replace=False)],
                 "gating_probs": [0.6, 0.4]}
                for p in range(2) for layer in range(2) for t in range(12)]
        (folder / "mixtral-8x7b" / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    (folder / "switch-base-8").mkdir()
    selections = rng.integers(0, 8, (60, 2, 1)).tolist()
    (folder / "switch-base-8" / "router-trace.v2.json").write_text(
        json.dumps({"expertsPerLayer": 8, "selections": selections}))
    spans = [{"id": f"p{i}", "token_start": 6 * i, "token_end_exclusive": 6 * i + 6}
             for i in range(10)]
    (folder / "switch-base-8" / "capture-metadata.json").write_text(
        json.dumps({"sparse_encoder_block_indices": [1, 3], "prompt_spans": spans}))
    return folder


def test_traces_suite_on_tiny_traces(tmp_path, capsys):
    report = suite(tmp_path / "out", "traces", "--traces", str(tiny_traces(tmp_path / "traces")))
    pairs = report["pairs"]
    assert [p["tokens"] for p in pairs] == [24, 24, 30, 30] and [p["k"] for p in pairs] == [2, 2, 1, 1]
    for pair in pairs:
        rates = pair["hit_rates"]
        for c in map(str, report["capacities"]):  # report.json's keys are text
            assert all(0 <= r[c] <= rates["belady"][c] + 1e-12 for r in rates.values())
        assert list(pair["imposed_gain"]["8"]) == [str(c) for c in range(pair["k"] + 1, 7)]
    text = (tmp_path / "out" / "report.md").read_text()
    first = pairs[0]["hit_rates"]
    gain = (first["learned"]["3"] - first["lru"]["3"]) * 100
    assert f"| learned − lru | {(first['learned']['1'] - first['lru']['1']) * 100:+.1f} | " \
           f"{(first['learned']['2'] - first['lru']['2']) * 100:+.1f} | {gain:+.1f} |" in text
    capsys.readouterr()
    missing = tmp_path / "nowhere"
    assert main(["bench", "--suite", "traces", "--traces", str(missing), "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{missing}: no such folder" in err


def test_plan_suite_measured_floor_is_what_the_store_accepts(mixtral_q8, tmp_path):
    import platform

    from moeswap.bench.scenarios import ModelFacts
    from moeswap.bench.suites.plan import PROMPT_TOKENS, STEP_TOKENS
    from moeswap.errors import MoeswapError
    from moeswap.experts.build import load_options
    from moeswap.experts.settings import OffloadSettings
    from moeswap.memory import HostCharge
    from moeswap.runtime import load

    cache = tmp_path / "probe.json"  # this host's entry, given: the suite measures nothing
    cache.write_text(json.dumps({f"{platform.node()} threads=1": {
        "disk_read": 2e9, "link": 1e10, "host_compute": 2e10, "device_compute": 2e10,
        "read_seconds": [[4096, 5e-5], [1 << 20, 1e-3]], "layer_step": 3e-4,
        "expert_call": 8e-5}}))
    out = tmp_path / "out"
    code = main(["bench", "-o", str(out), "--suite", "plan", "measured", "--model",
                 str(mixtral_q8), "--work-dir", str(tmp_path / "w"), "--probe-cache", str(cache),
                 "-n", "4", "--repeats", "1", "--shares", "0", "1.0"])
    report = json.loads((out / "report.json").read_text())
    assert report["suite"] == "plan" and code == (0 if report["passed"] else 1)
    assert str(cache) in report["rates"] and report["overheads"]["layer_step"] == 3e-4
    floor, full = report["rows"]
    # the plan's floor is the store's charge: at it the store holds no slot, at 100 % every one
    assert floor["host_bytes"] == floor["plan_host_charged"] == floor["store"]["host_charged"]
    assert floor["plan_host_slots"] == floor["store"]["host_slots"] == 0
    facts = ModelFacts.of(str(mixtral_q8))
    assert full["plan_host_slots"] == full["store"]["host_slots"] == \
        facts.n_expert * facts.moe_layers
    assert full["store"]["hit_rate"] >= floor["store"]["hit_rate"]
    assert all(r["measured_tok_s"] > 0 and len(r["runs"]) == 1 for r in report["rows"])
    assert [g["share"] for g in report["own_routing"]] == [0.0, 1.0]
    assert ("PASS" if floor["passed"] else "FAIL") in (out / "report.md").read_text()
    # a byte below the floor: the store refuses to load
    charge = HostCharge.for_sequence(PROMPT_TOKENS + 4, STEP_TOKENS)
    with pytest.raises(MoeswapError, match="--host-mem"):
        load(str(mixtral_q8), threads=1, **load_options(
            OffloadSettings(host_bytes=floor["host_bytes"] - 1), charge))


def test_plan_suite_worked_cases(tmp_path):
    report = suite(tmp_path / "out", "plan", "cases", "--work-dir", str(tmp_path / "w"))
    deepseek = tmp_path / "w" / "deepseek-v2-lite-q4_k_m.header.gguf"
    assert round(deepseek.stat().st_size / 1e9, 2) == 10.37  # the published Q4_K_M file's size
    plans = [case["plan"] for case in report["cases"]]
    assert [p["budget"]["device_bytes"] for p in plans] == [12e9, 6e9, 24e9, 24e9]
    assert round(plans[0]["bytes"]["total"] / 2**30, 2) == 9.66
    assert "--n-cpu-moe" not in plans[0]["llama_cpp"]["command"]
    assert plans[1]["llama_cpp"]["command"][-3:] == ["--n-cpu-moe", "17", "--mlock"]
    assert plans[2]["kv_cache"]["context_bytes_f16"] == 840 * 2**20  # 25 of 30 layers slide
    assert "multi_gpu" not in plans[2] and plans[3]["multi_gpu"]["gpus"] == 2
    assert "--tensor-parallel-size" in plans[3]["multi_gpu"]["vllm"]
    assert "given: device_compute, disk_read, host_compute, link" in \
        plans[0]["moeswap"]["rates"]["source"]


def test_rounds_must_be_one_or_more(tmp_path, capsys):
    assert main(["bench", "--suite", "decode", "--size", "smoke", "--rounds", "0",
                 "-o", str(tmp_path / "out")]) == 2  # a usage error, as argparse's
    assert "--rounds must be 1 or more, got 0" in capsys.readouterr().err


def test_a_failed_round_is_the_engines_result():
    from moeswap.bench.suites.decode import over_rounds

    ok = {"status": "ok", "prompt_tok_s": 10.0, "decode_tok_s": 5.0}
    failed = {"status": "timeout", "failure": "timeout", "error": "ran past 10 s"}
    assert over_rounds([ok, failed, ok]) == failed
    assert over_rounds([ok, dict(ok, prompt_tok_s=30.0)])["prompt_tok_s"] == 20.0


def test_time_to_first_token_leaves_out_a_prompts_extra_repeats(monkeypatch):
    """A prompt fed 3 times (its time the median) stands for one feeding: its time to first
    token and the wall time count the last repeat only. A fake clock: a prompt piece takes 1 s,
    a decode step 0.25 s."""
    from moeswap.bench import timing
    from moeswap.bench.memory import MemoryTrace
    from moeswap.bench.scenarios import RunSpec

    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    class Session:
        def reset(self) -> None:
            pass

        def feed(self, ids: list[int]) -> int:
            now[0] += 1.0 if len(ids) > 1 else 0.25
            return 7

    spec = RunSpec("decode", "test", "fake", "none", 1, [[1, 2, 3], [4, 5, 6]], 3, n_ctx=16,
                   prompt_repeats=3)
    result = timing.run_sequential(Session(), spec, MemoryTrace())
    # each prompt: 1 s of prefill (the last of 3 repeats), then 2 decode steps of 0.25 s
    assert result["prompt_s"] == 2.0 and result["decode_s"] == 1.0
    assert result["ttft_s"] == (1.0 + 2.5) / 2 and result["ttft_max_s"] == 2.5
    assert result["wall_s"] == 3.0
