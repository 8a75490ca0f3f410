"""The benchmark end to end: plan the runs, run each in a worker, write the report."""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moeswap.bench.environment import load_average, machine, versions
from moeswap.bench.plots import write_plots
from moeswap.bench.report import markdown
from moeswap.bench.scenarios import Inputs, ModelFacts, Plan, build_runs
from moeswap.bench.worker import run_isolated


def run_bench(plan: Plan, inputs_dir: Path, out_dir: Path, timeout_s: float | None,
              command: str, console: Console) -> dict:
    """Runs every scenario of ``plan``; writes report.json, report.md and the plots into
    ``out_dir`` (each run's spec and raw result under ``out_dir/runs``) -> the report."""
    from moeswap.tokenizer import load_tokenizer

    facts = ModelFacts.of(plan.model)
    tokenizer = load_tokenizer(Path(plan.model))
    runs = build_runs(plan, Inputs.read(inputs_dir), tokenizer.encode, facts)
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    records = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total} runs"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task("bench", total=len(runs))
        for i, spec in enumerate(runs):
            progress.update(task, description=f"{spec.scenario}: {spec.label}")
            name = f"{i:02d}-{spec.scenario}-{re.sub(r'[^a-z0-9]+', '-', spec.label.lower())}"
            result = run_isolated(spec, out_dir / "runs", name.strip("-"), timeout_s)
            records.append(with_merit({**spec.as_dict(), **result}))
            status = result["status"] if result["status"] == "ok" else \
                f"FAILED ({result['failure']}): {result['error']}"
            progress.console.print(f"{spec.scenario}: {spec.label}: {status}", markup=False)
            progress.advance(task)
    report = {"command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine(), "load_average": {"start": load_before, "end": load_average()},
              "versions": versions(), "model": facts.as_dict(),
              "sizes": asdict(plan.sizes), "threads": plan.threads, "runs": records}
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "report.md").write_text(markdown(report) + "\n")
    write_plots(report, out_dir)
    return report


def with_merit(record: dict) -> dict:
    """Adds the seeds' figure of merit: decode tokens/s per GB of peak resident memory."""
    ok = record["status"] == "ok" and record.get("decode_tok_s") and record.get("peak_rss_bytes")
    record["tok_s_per_gb"] = record["decode_tok_s"] / (record["peak_rss_bytes"] / 1e9) if ok else None
    return record
