"""moeswap doctor: the findings of formats.validation (the one validation the loader applies
too) for one file, as a table or JSON.

Every finding carries a stable rule id, a severity, a message naming the key or tensor, and
the fix. Files that cannot be parsed at all become one finding with the rule of their
``GGUFFormatError``. Exit codes: 0 clean, 1 warnings only, 2 errors.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moeswap.errors import GGUFFormatError
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.validation import ERROR, RULES, RULES_BY_ID, WARNING, Finding, check

__all__ = ["ERROR", "WARNING", "RULES", "RULES_BY_ID", "Finding", "Report", "diagnose", "render"]


@dataclass
class Report:
    path: str
    findings: list[Finding]

    @property
    def readable(self) -> bool:
        """False when the header could not be parsed (the one finding says why)."""
        return not any(RULES_BY_ID[f.rule].check is None for f in self.findings)

    @property
    def exit_code(self) -> int:
        if any(f.severity == ERROR for f in self.findings):
            return 2
        return 1 if self.findings else 0

    def rule_ids(self) -> list[str]:
        return sorted({f.rule for f in self.findings})

    def to_json(self) -> dict:
        return {"file": self.path, "exit_code": self.exit_code,
                "findings": [asdict(f) for f in self.findings]}


def diagnose(path: str | os.PathLike) -> Report:
    """Doctor one file: never raises for a bad file; parse failures become findings."""
    try:
        gf = GGUFFile.open(path)
    except GGUFFormatError as e:
        rule = RULES_BY_ID[e.rule]
        return Report(str(path), [Finding(rule.id, rule.severity, str(e), rule.fix)])
    try:
        return Report(str(path), check(gf))
    finally:
        gf.close()


def render(report: Report, console: Console) -> None:
    if not report.findings:
        console.print(f"{report.path}: no problems found")
        return
    table = Table(title=f"{report.path}: {len(report.findings)} finding(s)")
    table.add_column("severity")
    table.add_column("rule", no_wrap=True)
    table.add_column("problem", overflow="fold", ratio=3)
    table.add_column("fix", overflow="fold", ratio=2)
    for f in report.findings:
        style = "red" if f.severity == ERROR else "yellow"
        table.add_row(f"[{style}]{f.severity}[/]", f.rule, escape(f.message), escape(f.fix))
    console.print(table)
