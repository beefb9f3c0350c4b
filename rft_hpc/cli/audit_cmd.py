"""`rft-hpc audit RUN`: check a run's invariants from its buffer and ledgers."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from rft_hpc.core.console import console
from rft_hpc.ledger.audit import FAIL, PASS, AuditReport, StageAudit, audit_run

LISTED = 20
"""Problems printed per check (--json lists them all)."""

_STYLE = {PASS: "green", FAIL: "bold red"}


def stage_table(stage: StageAudit) -> Table:
    """One stage's checks: check, result, detail."""
    table = Table(title=f"stage {stage.name} ({stage.path})")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for check in stage.checks:
        style = _STYLE.get(check.result, "")
        table.add_row(check.name, f"[{style}]{check.result}[/]" if style else check.result,
                      escape(check.detail))
    return table


def print_report(report: AuditReport) -> None:
    """The tables, each failed check's problems, and the verdict line."""
    for stage in report.stages:
        console.print(stage_table(stage))
        for check in stage.checks:
            for problem in check.problems[:LISTED]:
                console.print(f"[red]{escape(check.name)}:[/] {escape(problem)}")
            if len(check.problems) > LISTED:
                console.print(f"[red]{escape(check.name)}:[/] ... "
                              f"{len(check.problems) - LISTED} more (see --json)")
    console.print("audit: PASS" if report.ok else f"audit: FAIL ({report.problems} problems)")


def audit(
    run: Path = typer.Argument(..., help="Run directory (or one stage directory of it)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON document."),
) -> None:
    """Check a run from its buffer and ledgers: exactly-once steps and consumption, weight
    versions, explorer segments. Exit 0 on PASS, 1 on FAIL."""
    report = audit_run(run)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    if not report.ok:
        raise typer.Exit(1)
