"""`rft-hpc export`: a run's published weights as a Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path

import typer

from rft_hpc.core.console import console


def export(
    run: Path = typer.Argument(..., metavar="RUN", help="Run directory."),
    out: Path = typer.Option(..., "--out", help="Folder to write (must not exist, or be "
                             "empty)."),
    version: int | None = typer.Option(None, "--version", help="Weights version (trainer "
                                       "step) to export; default the newest."),
    stage: str | None = typer.Option(None, "--stage", help="Stage whose weights to export; "
                                     "default the last one that published any."),
    merged: bool = typer.Option(False, "--merged", help="A LoRA run's adapter merged into "
                                "the base model, as a Hugging Face model folder (default: "
                                "the adapter as a peft adapter folder)."),
) -> None:
    """Write a published weights version as a Hugging Face folder (config, generation
    config, tokenizer with its chat template, safetensors shards) that transformers'
    from_pretrained and vLLM load as they are; a LoRA run's adapter as a peft adapter
    folder, or merged into the base with --merged."""
    from rft_hpc.sync.export import export_model

    record = export_model(run, out, version=version, stage=stage, merged=merged)
    console.print(f"exported weights v{record['version']} of {record['stage']} "
                  f"({record['kind']}, {record['dtype'] or 'mixed dtypes'}) to {out}: "
                  f"{', '.join(record['files'])}")
