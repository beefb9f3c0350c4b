"""The `rft-hpc` Typer application and its entry point.

Every command is a few lines that call the library. User errors (`UserError`, bad files,
bad options) end as one message on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from rft_hpc import __version__
from rft_hpc.errors import UserError

app = typer.Typer(
    name="rft-hpc",
    help="Reinforcement fine-tuning of language models as Slurm batch jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"rft-hpc {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=_version_callback,
        is_eager=True,
    ),
) -> None:
    """Reinforcement fine-tuning of language models as Slurm batch jobs."""


def _register_commands() -> None:
    # Imported here so that each command module can import `app` helpers without cycles.
    from rft_hpc.cli import buffer_cmd, demo_cmd, validate_cmd

    app.add_typer(buffer_cmd.app, name="buffer")
    app.command("validate")(validate_cmd.validate)
    app.command("demo")(demo_cmd.demo)


def report_user_error(exc: BaseException) -> None:
    """Print a user error as one clear message (no traceback)."""
    err_console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)


def main() -> None:
    """Console-script entry point: run the app, turning user errors into exit status 2."""
    _register_commands()
    try:
        app(standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except UserError as exc:
        report_user_error(exc)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as exc:  # click usage errors carry their own formatting
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
