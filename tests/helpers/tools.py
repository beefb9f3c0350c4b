"""Tools the suite needs beyond Python's own: present, skipped, or (under CI=true) failed.

A test (or module, with `pytestmark`) declares them with the markers
`@pytest.mark.needs_program("strace")` and `@pytest.mark.needs_module("megatron.core")`;
the root conftest checks them before the test's fixtures run (`check_needs`).
`tools/install.sh --test` installs every one of them, so in CI (`CI=true`, as `.ci/run`
runs) a missing tool is a broken install and fails each test that needs it, with the
message naming what is missing; on a developer's machine those tests are skipped instead.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

INSTALL = "bash tools/install.sh --test installs it"


def in_ci() -> bool:
    """Whether the suite runs in CI (`CI=true` in the environment)."""
    return os.environ.get("CI", "").strip().lower() == "true"


def missing(what: str) -> NoReturn:
    """Skip the calling test because `what` is missing; under CI=true fail it instead.
    Never returns."""
    message = f"{what} is missing ({INSTALL})"
    if in_ci():
        pytest.fail(f"{message}; under CI=true a missing tool fails the test", pytrace=False)
    pytest.skip(message)


def need_module(name: str) -> ModuleType:
    """The imported module `name`, or `missing(...)` if it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"Python module {name} ({exc})")


def need_executable(name: str) -> str:
    """The path of program `name` on PATH, or `missing(...)` if there is none."""
    path = shutil.which(name)
    if path is None:
        missing(f"program {name}")
    return path


def check_needs(item: pytest.Item) -> None:
    """Apply `missing(...)` to a test whose `needs_program` / `needs_module` markers name a
    tool that is not there; nothing for a test whose tools are all present."""
    for mark in item.iter_markers("needs_program"):
        for name in mark.args:
            need_executable(name)
    for mark in item.iter_markers("needs_module"):
        for name in mark.args:
            need_module(name)
