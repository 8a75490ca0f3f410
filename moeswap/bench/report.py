"""The benchmark's markdown: one table per scenario, then moeswap / llama.cpp ratios; and a
suite's report files."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

SCENARIO_TEXT = {
    "long": "one long multi-turn conversation filling the context, then a greedy continuation",
    "batch8": "8 distinct prompts at once: moeswap batched (the server's scheduler), llama.cpp "
              "one after another (time to first token includes waiting for earlier prompts)",
    "conflict": "the topic-jumping expert-conflict stress prompt",
    "window-sweep": "the conflict prompt, --policy window:N at the same RAM budget",
    "resident-sweep": "the conflict prompt, RAM budgets holding N experts per MoE layer",
}
COLUMNS = ("run", "RAM budget", "prompt tok/s", "decode tok/s", "TTFT s", "all tokens/s",
           "peak RssAnon MiB", "peak RSS MiB", "peak per tier MiB", "decode tok/s per GB RSS",
           "hit rate", "moved MiB", "status")
RATIOS = ("decode_tok_s", "prompt_tok_s", "throughput_tok_s", "tok_s_per_gb")


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def budget_text(run: dict) -> str:
    if run["budget_bytes"] is not None:
        return f"{mib(run['budget_bytes'])} MiB"
    if run["engine"] == "llama.cpp":
        return "none: llama.cpp takes no RAM budget"
    return "none (all resident)"


def row(run: dict) -> str:
    if run["status"] != "ok":
        cells = [run["label"], budget_text(run)] + ["-"] * 10 + \
                [f"FAILED ({run['failure']}): {run['error']}".replace("|", "/")]
        return "| " + " | ".join(cells) + " |"
    tiers = run["peak_tier_bytes"]
    tier_text = ", ".join(f"{t} {mib(b)}" for t, b in (tiers or {}).items() if b) or "-"
    hit = "-" if run["hit_rate"] is None else f"{run['hit_rate']:.1%}"
    cells = [run["label"], budget_text(run), num(run["prompt_tok_s"]), num(run["decode_tok_s"], 2),
             num(run["ttft_s"], 3), num(run["throughput_tok_s"], 2), mib(run["peak_anon_bytes"]),
             mib(run["peak_rss_bytes"]), tier_text, num(run["tok_s_per_gb"]), hit,
             mib(run["bytes_moved"]), "ok"]
    return "| " + " | ".join(cells) + " |"


def ratio_rows(runs: list[dict]) -> list[str]:
    """Each moeswap run over the scenario's llama.cpp all-in-RAM run."""
    reference = next((r for r in runs if r["engine"] == "llama.cpp" and not r["llama_mmap"]
                      and r["status"] == "ok"), None)
    if reference is None:
        return []
    lines = []
    for run in runs:
        if run["engine"] != "moeswap" or run["status"] != "ok":
            continue
        cells = [f"{run[k] / reference[k]:.2f}x" if run[k] and reference[k] else "-"
                 for k in RATIOS]
        cells.append("- (replayed routing)" if run["replay_routing"] else
                     agreement(run["outputs"], reference["outputs"]))
        lines.append(f"| {run['label']} | " + " | ".join(cells) + " |")
    return lines


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """How many greedy tokens equal llama.cpp's before the first difference, over all prompts."""
    same = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
               for x, y in zip(ours, theirs))
    return f"{same} of {sum(map(len, theirs))}"


def markdown(report: dict) -> str:
    m, v, model = report["machine"], report["versions"], report["model"]
    lines = [f"Command: `{report['command']}` ({report['date']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {mib(m['ram_bytes'])} MiB RAM, {m['os']}; "
             f"threads {report['threads']} for both engines; load average (1, 5, 15 min) "
             f"{report['load_average']['start']} at the start, {report['load_average']['end']} "
             "at the end.",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".",
             f"Model: {model['path']} ({model['file_bytes'] / 1e6:.1f} MB; {model['n_expert']} "
             f"experts top-{model['n_used']} in {model['moe_layers']} MoE layers; one expert "
             f"{mib(model['slot_bytes'])} MiB; shared weights {mib(model['shared_bytes'])} MiB).",
             f"Sizes: {report['sizes']}.", ""]
    scenarios = list(dict.fromkeys(r["scenario"] for r in report["runs"]))
    for scenario in scenarios:
        runs = [r for r in report["runs"] if r["scenario"] == scenario]
        first = runs[0]
        prompts = first["prompt_lengths"]
        prompt_text = f"{prompts[0]} prompt tokens" if len(prompts) == 1 else \
            f"{len(prompts)} prompts of {min(prompts)}-{max(prompts)} tokens"
        lines += [f"### {scenario}", "",
                  f"{SCENARIO_TEXT[scenario]}; {prompt_text}, {first['gen_tokens']} generated "
                  f"per prompt, n_ctx {first['n_ctx']} per sequence.", "",
                  "| " + " | ".join(COLUMNS) + " |",
                  "|---|---|" + "---:|" * (len(COLUMNS) - 3) + "---|"]
        lines += [row(r) for r in runs]
        ratios = ratio_rows(runs)
        if ratios:
            lines += ["", "moeswap / llama.cpp (all in RAM):", "",
                      "| run | decode | prompt | all tokens/s | decode tok/s per GB "
                      "| greedy tokens as llama.cpp's (up to the first difference) |",
                      "|---|---:|---:|---:|---:|---|", *ratios]
        lines.append("")
    return "\n".join(lines)


def write_suite_report(out_dir: Path, suite: str, command: str, body: dict, text: str) -> dict:
    """A suite's report.json (``body`` with where and when it ran) and report.md (a header,
    then ``text``) in ``out_dir`` -> the report."""
    from moeswap.bench.environment import load_average, machine, versions

    report = {**body, "suite": suite, "command": command,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
              "load_average": load_average(), "versions": versions()}
    m = report["machine"]
    header = [f"Command: `{command}` ({report['date']})", "",
              f"Machine: {m['cpu']}, {m['cores']} cores, {mib(m['ram_bytes'])} MiB RAM, "
              f"{m['os']}; load average (1, 5, 15 min) {report['load_average']} at the end.",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v)
              + ".", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "report.md").write_text("\n".join(header) + text.rstrip() + "\n")
    return report
