"""`moeswap bench` end to end on a tiny Mixtral-layout Q8_0 model at smoke size: every scenario
runs in worker processes, each run either finishes with its figures or records its failure
(one is injected: `--windows 0` names a policy the store refuses), and the JSON, markdown and
PNG plots are written. A run charges its store and prefills as `moeswap run` (prompts one after
another) and `moeswap serve` (a batch) do. The llama.cpp side runs where llama-cpp-python is
installed."""

from __future__ import annotations

import json

import pytest

from moeswap.cli import main

OK_FIELDS = ("prompt_tok_s", "decode_tok_s", "ttft_s", "throughput_tok_s", "peak_anon_bytes",
             "peak_rss_bytes", "tok_s_per_gb", "load_s", "outputs", "memory_trace")
GEN = 3


def bench(path, out, *flags) -> dict:
    code = main(["bench", str(path), "--size", "smoke", "--gen-tokens", str(GEN),
                 "--threads", "1", "-o", str(out), *flags])
    assert code == 0
    return json.loads((out / "report.json").read_text())


def test_every_scenario_finishes_or_records_its_failure(mixtral_q8, tmp_path):
    # conflict is left out to save time: it runs as long does, on another prompt
    report = bench(mixtral_q8, tmp_path, "--scenarios", "long,batch8,window-sweep,resident-sweep",
                   "--windows", "0", "--resident", "0")
    runs = report["runs"]
    assert [(r["scenario"], r["label"]) for r in runs] == [
        ("long", "moeswap all resident"), ("long", "moeswap lru, host 2 experts/layer"),
        ("batch8", "moeswap all resident"), ("batch8", "moeswap lru, host 2 experts/layer"),
        ("window-sweep", "moeswap window:0, host 2 experts/layer"),
        ("resident-sweep", "moeswap lru, 0 resident/layer"),
        ("resident-sweep", "moeswap all resident")]

    failed = [r for r in runs if r["status"] != "ok"]
    assert [(r["label"], r["failure"]) for r in failed] == [
        ("moeswap window:0, host 2 experts/layer", "error")]
    assert "unknown policy 'window:0'" in failed[0]["error"]

    for run in runs:
        if run["status"] != "ok":
            continue
        assert all(run[f] is not None for f in OK_FIELDS), run["label"]
        assert [len(tokens) for tokens in run["outputs"]] == [GEN] * len(run["prompt_lengths"])
        if run["offload"] is None:
            assert run["hit_rate"] is None and run["peak_tier_bytes"] is None
            continue
        assert 0.0 <= run["hit_rate"] <= 1.0 and run["bytes_moved"] > 0
        assert run["peak_tier_bytes"]["host"] <= run["budget_bytes"]
        assert all("tiers" in s for s in run["memory_trace"][1:])  # every sample from load on

    by_key = {(r["scenario"], r["label"]): r for r in runs}
    # The store is exact: the same greedy tokens as all resident, alone and batched.
    for scenario in ("long", "batch8"):
        assert by_key[(scenario, "moeswap lru, host 2 experts/layer")]["outputs"] == \
            by_key[(scenario, "moeswap all resident")]["outputs"]
    # No resident experts: nothing is a hit; every pick is read from the file.
    assert by_key[("resident-sweep", "moeswap lru, 0 resident/layer")]["hit_rate"] == 0.0
    # One memory sample at start, after load and warm-up, per prompt piece and per decode step.
    long = by_key[("long", "moeswap all resident")]
    assert [s["step"] for s in long["memory_trace"]] == \
        ["start", "load", "warm-up", "prefill"] + ["decode"] * (GEN - 1)

    markdown = (tmp_path / "report.md").read_text()
    assert "| moeswap window:0, host 2 experts/layer |" in markdown and "FAILED (error)" in markdown
    for name in ("tokens-vs-budget", "memory-long", "memory-batch8", "memory-resident-sweep"):
        assert (tmp_path / f"bench-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("batched", [False, True], ids=["one-after-another", "batch"])
def test_a_run_charges_and_prefills_as_run_and_serve_do(mixtral_q8, monkeypatch, batched):
    """The store is charged the KV caches and working memory of a ``prefill_chunk``-token
    step -- one sequence as `moeswap run` charges it, or the batch as `moeswap serve` does --
    and no forward feeds a sequence more than ``prefill_chunk`` tokens."""
    from moeswap import runtime
    from moeswap.bench import moeswap_runner
    from moeswap.bench.scenarios import RunSpec
    from moeswap.experts import build
    from moeswap.experts.settings import OffloadSettings
    from moeswap.memory import HostCharge

    charged, fed = [], []

    def capture(settings, charge, rates=None):
        charged.append(charge)
        return {}  # all resident: the charge is what is checked

    def counting_load(*args, **kwargs):
        loaded = load(*args, **kwargs)
        forward = loaded.model.forward

        def counted(tokens, caches, last_only=False):
            fed.append([int(t.numel()) for t in tokens])
            return forward(tokens, caches, last_only)

        monkeypatch.setattr(loaded.model, "forward", counted)
        return loaded

    load = runtime.load
    monkeypatch.setattr(build, "load_options", capture)
    monkeypatch.setattr(runtime, "load", counting_load)
    prompts = [list(range(3, 23)), list(range(5, 15)), list(range(4, 10))][:3 if batched else 1]
    n_ctx, chunk = 20 + GEN, 8
    spec = RunSpec("batch8" if batched else "conflict", "test", "moeswap", str(mixtral_q8), 1,
                   prompts, GEN, n_ctx, batched=batched,
                   offload=OffloadSettings(host_bytes=1 << 30), prefill_chunk=chunk)
    result = moeswap_runner.run(spec)
    assert [len(tokens) for tokens in result["outputs"]] == [GEN] * len(prompts)
    assert charged == [HostCharge(context_tokens=n_ctx, sequences=3 if batched else 1,
                                  step_tokens=chunk, kv_type="f16")]  # the commands' default
    assert max(max(step) for step in fed) == chunk and max(sum(step) for step in fed) <= chunk
    if not batched:  # warm-up: 16 tokens in two chunks and a step; then 20 in three
        assert fed == [[8], [8], [1], [8], [8], [4]] + [[1]] * (GEN - 1)


def test_bad_scenario_is_one_line_error(mixtral_q8, tmp_path, capsys):
    assert main(["bench", str(mixtral_q8), "--scenarios", "long,nope", "-o", str(tmp_path)]) == 2
    assert "unknown scenario 'nope'" in capsys.readouterr().err


@pytest.mark.llama_cpp
def test_llama_cpp_beside_moeswap(tmp_path):
    """On the trained built-in model (Q8_0), moeswap resident and offloaded, and llama.cpp read
    into RAM and mapped, decode the same 8 greedy tokens."""
    pytest.importorskip("llama_cpp", reason="the llama.cpp side needs llama-cpp-python")
    import moeswap

    report = bench(moeswap.DEFAULT_MODEL, tmp_path, "--scenarios", "conflict",
                   "--compare", "llama.cpp", "--gen-tokens", "8")
    runs = {r["label"]: r for r in report["runs"]}
    assert list(runs) == ["moeswap all resident", "moeswap lru, host 4 experts/layer",
                          "llama.cpp all in RAM (no mmap)", "llama.cpp mmap (page cache)"]
    assert all(r["status"] == "ok" for r in runs.values()), [r.get("error") for r in runs.values()]
    llama = runs["llama.cpp all in RAM (no mmap)"]
    assert llama["budget_bytes"] is None and llama["hit_rate"] is None
    assert [len(tokens) for tokens in llama["outputs"]] == [8] * len(llama["prompt_lengths"])
    for label, run in runs.items():
        assert run["outputs"] == llama["outputs"], label
    markdown = (tmp_path / "report.md").read_text()
    assert "none: llama.cpp takes no RAM budget" in markdown
    assert "moeswap / llama.cpp (all in RAM):" in markdown
