"""`moeswap bench --suite server --chat-turns N` (issue 24): a short chat on the built-in model
against `moeswap serve` and llama-cpp-python's server, both started by the suite on
127.0.0.1 — the report's turns, prompt and cached tokens, in JSON and markdown. A smoke test
of the plumbing (2 turns, 2 reply tokens); the measurement is the lead's, on a quiet machine
(docs/SERVER.md)."""

from __future__ import annotations

import json

from moeswap.cli import main


def test_chat_turns_run_against_both_servers_and_report_cached_tokens(tmp_path):
    out = tmp_path / "chat"
    assert main(["bench", "-o", str(out), "--suite", "server", "--chat-turns", "2",
                 "--first-tokens", "100", "--max-tokens", "2", "--ctx", "512",
                 "--threads", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["suite"] == "server" and report["mode"] == "chat turns"
    assert set(report["engines"]) == {"moeswap", "llama-cpp-python"}
    for engine, result in report["engines"].items():
        first, second = result["turns"]
        assert first["prompt_tokens"] >= 100 and second["prompt_tokens"] > first["prompt_tokens"]
        assert first["completion_tokens"] <= 2 and first["seconds"] > 0
        # turn 2 reuses turn 1's prompt (moeswap) or more (llama.cpp keeps the reply too)
        assert second["cached_tokens"] >= first["prompt_tokens"] - 2, (engine, result)
        assert result["later_speedup"] > 0
    moeswap = report["engines"]["moeswap"]["turns"]
    assert moeswap[1]["cached_tokens"] == moeswap[0]["prompt_tokens"]
    text = (out / "report.md").read_text()
    assert "| turn | moeswap prompt tokens | moeswap cached | moeswap s |" in text
    assert "later turns" in text


def test_chat_turns_refuse_flags_the_suite_sets(tmp_path, capsys):
    assert main(["bench", "-o", str(tmp_path), "--suite", "server", "--chat-turns", "2",
                 "--serve-args", "--max-batch 4"]) == 2
    assert "--serve-args may not set --max-batch: the suite sets it" in capsys.readouterr().err
