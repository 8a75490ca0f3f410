"""`moeswap inspect`, `moeswap doctor`, `moeswap fix`: parse arguments, call gguf_tools."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

from moeswap.cli.console import stdout_console
from moeswap.gguf_tools import doctor, fix, inspect


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="MoE-aware summary of a GGUF file (header only)")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--tensors", action="store_true", help="also list every tensor")
    p.set_defaults(handler=run_inspect)

    p = subparsers.add_parser("doctor", help="validate a GGUF file; exit 0 clean, 1 warnings, "
                                             "2 errors")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=run_doctor)

    p = subparsers.add_parser("fix", help="write a repaired copy of a GGUF file")
    p.add_argument("file", help="the .gguf file (never modified)")
    p.add_argument("-o", "--output", required=True,
                   help="path of the repaired file (a split set: its pieces are named from it, "
                        "NAME-00001-of-0000N.gguf ...)")
    p.add_argument("--merge", action="store_true",
                   help="write a split set as one file (without the split.* keys)")
    p.add_argument("--dry-run", action="store_true", help="show what would change, write nothing")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="set a metadata key (repeatable); llama.cpp's integer keys become u32")
    p.set_defaults(handler=run_fix)


def run_inspect(args) -> int:
    report = inspect.inspect_file(args.file)
    if args.json:
        print(json.dumps(report.to_json(with_tensors=args.tensors), indent=2))
    else:
        inspect.render(report, stdout_console(), with_tensors=args.tensors)
    return 0


def run_doctor(args) -> int:
    report = doctor.diagnose(args.file)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    elif not report.readable:
        finding = report.findings[0]
        print(f"moeswap: error: {finding.message} [{finding.rule}]", file=sys.stderr)
    else:
        doctor.render(report, stdout_console(soft_wrap=True))
    return report.exit_code


def run_fix(args) -> int:
    console = stdout_console(soft_wrap=True, markup=False, highlight=False)
    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task("writing", start=False)

    def on_start(total: int) -> None:  # shown only once fix actually writes
        bar.update(task, total=total)
        bar.start()
        bar.start_task(task)

    try:
        result = fix.fix_file(args.file, args.output, args.assignments, dry_run=args.dry_run,
                              on_progress=lambda n: bar.advance(task, n), on_start=on_start,
                              merge=args.merge)
    finally:
        if bar.live.is_started:
            bar.stop()
    plan = result.plan
    for action in plan.actions:
        console.print(f"{'would ' if args.dry_run else ''}{action}")
    if args.dry_run:
        for f in plan.remaining:
            console.print(f"{f.severity}: [{f.rule}] {f.message} (fix: {f.fix})")
        outputs = fix.output_paths(Path(args.output), len(plan.files)) if plan.files else []
        more = f" and {len(outputs) - 1} more piece(s) of its set" if len(outputs) > 1 else ""
        verdict = "would be refused" if plan.blockers else f"would write {outputs[0]}{more}"
        console.print(f"dry run: {verdict}; nothing written")
        return 2 if plan.blockers else 0
    if result.output is None:
        console.print(f"{args.file}: nothing to repair; no output written")
        return 0
    warnings = len(result.report.findings)
    pieces = len(plan.files)
    more = f" and {pieces - 1} more piece(s) of its set" if pieces > 1 else ""
    console.print(f"wrote {result.output}{more} (doctor: "
                  f"{'clean' if not warnings else f'{warnings} warning(s)'})")
    return 0
