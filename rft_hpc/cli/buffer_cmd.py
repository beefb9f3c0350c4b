"""`rft-hpc buffer ...`: inspect, import, export and verify an experience buffer."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import typer
from rich.table import Table

from rft_hpc.buffer.check import WriterSummary, summarize_buffer, verify_buffer
from rft_hpc.buffer.jsonl import KINDS, export_jsonl, import_jsonl
from rft_hpc.core.console import console, err_console
from rft_hpc.core.errors import UserError

app = typer.Typer(help="Inspect, import, export and verify an experience buffer.",
                  no_args_is_help=True)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _span(span: list[int] | None, *, end_exclusive: bool = False) -> str:
    return "-" if span is None else f"{span[0]}..{span[1] - end_exclusive}"


def summary_table(rows: list[WriterSummary], title: str) -> Table:
    """The per-writer table that `buffer inspect` prints."""
    table = Table(title=title)
    for col in ("writer", "kind", "segments", "records", "steps", "policy versions",
                "reward mean", "reward std", "tokens"):
        table.add_column(col, justify="left" if col in ("writer", "kind") else "right")
    for r in rows:
        notes = ([f"{r.archives} archives"] if r.archives else []) + \
            ([f"{r.corrupt_segments} corrupt"] if r.corrupt_segments else [])
        segs = f"{r.segments}" + (f" ({', '.join(notes)})" if notes else "")
        table.add_row(r.writer, ",".join(r.kinds) or "-", segs, str(r.records),
                      _span(r.steps, end_exclusive=True),
                      _span(r.policy_versions), _fmt(r.reward_mean), _fmt(r.reward_std),
                      str(r.tokens))
    if len(rows) > 1:
        table.add_row("total", "", str(sum(r.segments for r in rows)),
                      str(sum(r.records for r in rows)), "", "", "", "",
                      str(sum(r.tokens for r in rows)), style="bold")
    return table


@app.command("inspect")
def inspect_cmd(
    buffer: Path = typer.Argument(..., help="Buffer folder (e.g. RUN/buffer)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Per writer: segments, records, steps, policy versions, reward mean/std, tokens."""
    rows = summarize_buffer(buffer)
    if as_json:
        typer.echo(json.dumps({"buffer": str(buffer), "writers": [asdict(r) for r in rows]},
                              indent=2))
        return
    if not rows:
        console.print(f"{buffer}: empty buffer (no committed segments)")
        return
    console.print(summary_table(rows, str(buffer)))


@app.command("import")
def import_cmd(
    file: Path = typer.Argument(..., help="JSONL file, one record per line."),
    kind: str = typer.Option(..., "--kind", help=f"Record kind: {'|'.join(KINDS)}."),
    out: Path = typer.Option(..., "--out", help="Buffer folder to import into."),
    tokenizer: Path | None = typer.Option(
        None, "--tokenizer", help="Local tokenizer folder (needed for lines given as text)."),
    writer: str | None = typer.Option(
        None, "--writer", help="Writer folder name in the buffer (default: import-<file stem>)."),
) -> None:
    """Import a JSONL file as a new writer of a buffer; any bad line aborts the whole import."""
    if tokenizer is not None and not tokenizer.exists():
        raise UserError(f"tokenizer folder {tokenizer} does not exist")
    result = import_jsonl(file, kind, out, tokenizer=tokenizer, writer=writer)
    console.print(f"imported {result.records} {kind} record(s) from {file} into "
                  f"{result.writer_dir} ({result.segments} segment(s))")


@app.command("export")
def export_cmd(
    buffer: Path = typer.Argument(..., help="Buffer folder."),
    out: Path = typer.Option(..., "--out", help="JSONL file to write."),
) -> None:
    """Export every record in token form (re-importable without a tokenizer)."""
    if not out.parent.is_dir():
        raise UserError(f"folder {out.parent} does not exist")
    count = export_jsonl(buffer, out, warn=lambda m: err_console.print(f"[yellow]warning:[/] {m}"))
    console.print(f"exported {count} record(s) to {out}")


@app.command("verify")
def verify_cmd(
    buffer: Path = typer.Argument(..., help="Buffer folder."),
    fix: bool = typer.Option(False, "--fix", help="Move corrupt segments to quarantine/."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check every segment's structure and checksums; exit 1 if corrupt ones remain."""
    report = verify_buffer(buffer, fix=fix)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        for p in report.problems:
            action = f" -> quarantined to {p.quarantined_to}" if p.quarantined_to else ""
            err_console.print(f"[red]corrupt[/] {p.path}: {p.reason}{action}")
        for t in report.temporaries:
            err_console.print(f"[yellow]temporary file[/] {t} (a writer's unfinished segment)")
        verdict = ("OK" if not report.problems
                   else f"{len(report.problems)} corrupt segment(s)"
                   + ("" if report.unfixed else ", all quarantined"))
        held = f" ({report.archives} archive(s))" if report.archives else ""
        console.print(f"{buffer}: {report.segments} segment(s){held}, {report.records} readable "
                      f"record(s): {verdict}")
    if report.unfixed:
        raise typer.Exit(1)
