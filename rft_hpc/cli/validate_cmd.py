"""`rft-hpc validate`: check a config file (and overrides) without running anything."""

from __future__ import annotations

from pathlib import Path

import typer

from rft_hpc.config import load_config
from rft_hpc.tasks.data_check import check_task_sources
from rft_hpc.tasks.preflight import PREFLIGHT_CHECKS


def validate(
    config: Path = typer.Argument(..., metavar="CONFIG", help="Experiment config file (YAML)."),
    set_: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE",
        help="Override one setting, e.g. --set trainer.lr=1e-5 (repeatable).",
    ),
) -> None:
    """Check a config file and its overrides without running anything.

    Prints a one-line summary and exits 0 when valid; else lists every problem, exit 2.
    Task files are read too: a missing column or a bad row is reported with its file and
    row, exit 2. Every reward is imported and its arguments bound to its signature.
    """
    # A `ConfigError` or `UserError` propagates: `app.main` prints it as one message and
    # exits 2.
    cfg = load_config(config, set_, checks=PREFLIGHT_CHECKS)
    check_task_sources(cfg)
    typer.echo(
        f"OK: {config} (mode={cfg.mode}, {cfg.explorer.count} explorer(s), "
        f"trainer {cfg.algorithm.algorithm_type})"
    )
