"""The `rft-hpc` Typer application and its entry point.

Every command is a few lines that call the library. User errors (`UserError`, bad files,
bad options) end as one message on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import contextlib
import sys

import typer
from rich.markup import escape

from rft_hpc import __version__
from rft_hpc.core.console import err_console
from rft_hpc.core.errors import UserError
from rft_hpc.core.storage import StorageFull, advice, exit_status, storage_full
from rft_hpc.runtime.lifecycle import REQUEUE_EXIT, RequeueRequested

app = typer.Typer(
    name="rft-hpc",
    help="Reinforcement fine-tuning of language models as Slurm batch jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



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
    log_level: str | None = typer.Option(
        None, "--log-level", help="What the roles' logs hold: DEBUG, INFO (the default), "
        "WARNING or ERROR; passed on to every role process, local or in Slurm jobs."),
) -> None:
    """Reinforcement fine-tuning of language models as Slurm batch jobs."""
    if log_level is not None:
        from rft_hpc.runtime.logs import set_log_level

        set_log_level(log_level)


def _register_commands() -> None:
    # Imported here so that each command module can import `app` helpers without cycles.
    from rft_hpc.cli import (
        audit_cmd,
        buffer_cmd,
        data_cmd,
        eval_cmd,
        export_cmd,
        run_cmd,
        slurm_cmd,
        status_cmd,
        validate_cmd,
    )

    app.command("run")(run_cmd.run)
    for command in (slurm_cmd.submit, slurm_cmd.render, slurm_cmd.cancel, slurm_cmd.logs,
                    slurm_cmd.resume):
        app.command(command.__name__)(command)
    app.command("status")(status_cmd.status)
    app.command("validate")(validate_cmd.validate)
    app.command("audit")(audit_cmd.audit)
    app.command("eval")(eval_cmd.eval_)
    app.command("export")(export_cmd.export)
    run_cmd.role_app.command("bench")(eval_cmd.role_bench)
    run_cmd.role_app.command("bench-collect")(eval_cmd.role_bench_collect)
    run_cmd.role_app.command("bench-stage")(eval_cmd.role_bench_stage)
    app.add_typer(buffer_cmd.app, name="buffer")
    app.add_typer(data_cmd.app, name="data")
    app.add_typer(run_cmd.model_app, name="model")
    app.add_typer(run_cmd.role_app, name="role", hidden=True)


def report_user_error(exc: BaseException | str) -> None:
    """Print a user error as one clear message (no traceback)."""
    # The message is plain text: escape it, or rich would eat "[...]" and choke on "[/]".
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False)


def report_storage_full(full: StorageFull) -> None:
    """Say, as one line on stderr, that this process (a role, or the launcher) stops on a
    full disk or an exceeded quota, and what to do; a local role also tells its launcher
    (stderr is its log file, maybe on that very disk)."""
    import os

    from rft_hpc.runtime.command import report_to_launcher
    from rft_hpc.runtime.logs import current_role

    again = ("resume the run (rft-hpc resume RUN)" if os.environ.get("SLURM_JOB_ID")
             else "run the same command again")
    message = f"{current_role()} stopped: {full.describe()}: {advice(full, again)}"
    report_to_launcher(message)
    with contextlib.suppress(Exception):
        report_user_error(message)
        sys.stderr.flush()


def main() -> None:
    """Console-script entry point: run the app, turning user errors into exit status 2 (a
    stop on a full disk or an exceeded quota into its errno, 28 or 122: `StorageFull`) and a
    role's request to be requeued into `REQUEUE_EXIT`."""
    _register_commands()
    try:
        # Without standalone mode, click returns the code of a `typer.Exit` instead of raising.
        status = app(standalone_mode=False)
        if isinstance(status, int) and not isinstance(status, bool) and status != 0:
            sys.exit(status)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except UserError as exc:
        report_user_error(exc)
        sys.exit(getattr(exc, "exit_status", 2))
    except RequeueRequested as exc:  # a role saved and asks to be started again
        err_console.print(f"rft-hpc: {exc}")
        sys.exit(REQUEUE_EXIT)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as exc:  # click usage errors carry their own formatting
        if isinstance(exc, _usage_error_types()) and hasattr(exc, "show"):
            exc.show()
            sys.exit(getattr(exc, "exit_code", 2))
        full = storage_full(exc)
        if full is not None:  # no traceback: one message, and the errno as exit status
            report_storage_full(full)
            sys.exit(exit_status(full))
        raise


def _usage_error_types() -> tuple[type[Exception], ...]:
    """Base classes of click's usage errors (missing argument, unknown option): typer >= 0.2x
    vendors click as `typer._click` (its errors derive from `typer.TyperException`) and need
    not install click; older typers raise click's own `ClickException`."""
    kinds: list[type[Exception]] = []
    if hasattr(typer, "TyperException"):
        kinds.append(typer.TyperException)
    try:
        import click
    except ImportError:
        pass
    else:
        kinds.append(click.ClickException)
    return tuple(kinds)
