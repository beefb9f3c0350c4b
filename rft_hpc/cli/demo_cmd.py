"""`rft-hpc demo`: the embedded default experiment (for now: a buffer round trip)."""

from __future__ import annotations

from pathlib import Path

import typer

from rft_hpc.buffer.check import summarize_buffer
from rft_hpc.cli.buffer_cmd import summary_table
from rft_hpc.cli.output import console
from rft_hpc.demo import buffer_round_trip


def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Run directory to use."),
) -> None:
    """Run the demo on this machine: build a tokenizer, write, read and round-trip a buffer."""
    result = buffer_round_trip(out)
    console.print(summary_table(summarize_buffer(result.run_dir / "buffer"),
                                f"{result.run_dir}/buffer"))
    console.print(f"records written {result.records_written}, read back exactly once "
                  f"{result.records_read}; export -> import round trip of "
                  f"{result.round_trip_records} records identical: "
                  f"{result.round_trip_identical}; corrupt segments: {result.corrupt_segments}")
    if not result.ok:
        console.print("[red]demo FAILED[/]")
        raise typer.Exit(1)
    console.print("[green]demo OK[/]")
