"""The logging of role processes: one setup for every role, its level, the step line.

A role's stdout and stderr are its log file (`jobs/<role>.log` locally, the job's output
under Slurm), so log records go to stderr. Every role writes one INFO line per step
(`step_line`: step/total, weight version, mean reward, seconds); warnings and errors name
the step the role was on (`at_step`). The level is `RFT_LOG_LEVEL` (`--log-level`), which
`role_env` passes on to every role process, local or in a Slurm job; it applies to
rft-hpc's own loggers, while other libraries show their warnings and errors at any level.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

from rft_hpc.core.errors import UserError
from rft_hpc.core.retry import open_append
from rft_hpc.core.storage import storage_full

LOG_LEVEL_ENV = "RFT_LOG_LEVEL"
"""Environment variable with the roles' log level (DEBUG, INFO, WARNING, ERROR)."""

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL = "INFO"
FORMAT = "%(asctime)s %(levelname)s %(role)s%(at_step)s: %(message)s"

_current: dict[str, object] = {"role": "rft-hpc", "step": None}
_thread = threading.local()
"""A colocated loop's thread: its own role and step (`thread_role`)."""


def parse_level(text: str) -> str:
    """The level named by `text` (any case), or a `UserError` listing the valid ones."""
    level = text.strip().upper()
    if level not in LEVELS:
        raise UserError(f"unknown log level {text!r}: use one of {', '.join(LEVELS)}")
    return level


def set_log_level(text: str) -> str:
    """Make `text` the log level of every role this process starts (checked; returned)."""
    level = parse_level(text)
    os.environ[LOG_LEVEL_ENV] = level
    return level


def log_level() -> str:
    """This process's level: `RFT_LOG_LEVEL` if set, else INFO."""
    return parse_level(os.environ.get(LOG_LEVEL_ENV) or DEFAULT_LEVEL)


class _RoleFields(logging.Filter):
    """Puts the role and, on warnings and errors, the current step into each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = getattr(_thread, "role", None) is not None
        record.role = _thread.role if own else _current["role"]
        step = _thread.step if own else _current["step"]
        record.at_step = (f" [step {step}]" if step is not None
                          and record.levelno >= logging.WARNING else "")
        return True


class _RoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `setup_logging` installs (told apart from handlers of others)."""

    def handleError(self, record: logging.LogRecord) -> None:
        """A log on a full disk: the record is lost without a traceback (which could not be
        written either); the role stops at its next write of state, which fails too."""
        if storage_full(sys.exc_info()[1]) is None:
            super().handleError(record)


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """A helper thread's failure on a full disk is raised again by whoever waits for the
    thread (a writer's flush, a commit): no traceback of its own."""
    if storage_full(args.exc_value) is None:
        threading.__excepthook__(args)


def current_role() -> str:
    """The role this process runs as (`setup_logging`), `rft-hpc` outside a role."""
    return str(_current["role"])


class _OfRole(logging.Filter):
    """Passes only the records of one role (a colocated loop's thread)."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(_thread, "role", None) == self.role


def log_role_to(role: str, path: Path) -> None:
    """Also append the records of the threads that log as `role` (`thread_role`) to the
    file `path`: a colocated process keeps each loop's own log (`jobs/<role>.log`) beside
    its whole output."""
    stream = os.fdopen(open_append(path, mode=0o644, what="log"), "a", buffering=1,
                       encoding="utf-8")
    handler = _RoleHandler(stream)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RoleFields())
    handler.addFilter(_OfRole(role))
    logging.getLogger().addHandler(handler)


def setup_logging(role: str) -> None:
    """Send log records of this process to stderr as `<time> <LEVEL> <role>: <message>`,
    at `log_level()` for rft-hpc's loggers (WARNING for other libraries' below that).
    Calling it again (another role name, a new level) replaces the earlier setup."""
    level = logging.getLevelName(log_level())
    _current.update(role=role, step=None)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _RoleHandler)]:
        root.removeHandler(old)
    handler = _RoleHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RoleFields())
    root.addHandler(handler)
    root.setLevel(max(level, logging.WARNING))
    threading.excepthook = _thread_failed
    logging.getLogger("rft_hpc").setLevel(level)


def at_step(step: int | None) -> None:
    """The step the role works on now (1-based, as `step_line` counts), named by later
    warnings and errors; None once it is between steps for good."""
    if getattr(_thread, "role", None) is not None:
        _thread.step = step
    else:
        _current["step"] = step


def thread_role(role: str | None) -> None:
    """Log the calling thread's records as `role`'s, with its own step (`at_step`): one of
    the loops of a colocated process; None: the process's role again."""
    _thread.role, _thread.step = role, None


def step_line(step: int, total: int | None, *, version: int | str | None,
              reward: float | None, seconds: float, **more: object) -> str:
    """The INFO line of one finished step: `step 3/6 version 2 reward 0.412 1.23 s`, then
    `more` as `key value` pairs."""
    parts = [f"step {step}/{'-' if total is None else total}",
             f"version {'-' if version is None else version}",
             f"reward {'-' if reward is None else f'{reward:.3f}'}", f"{seconds:.2f} s"]
    parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in more.items()]
    return " ".join(parts)
