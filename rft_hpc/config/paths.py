"""Path settings with `${VAR}` and `~` expanded: scratch and project folders differ per user.

Every path setting of a config is a `ConfigPath`. Expansion happens when the config is
validated, so the config a run freezes (its config.yaml) holds the expanded paths, and the
roles that read it later, on other nodes, never expand anything again.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator

_VARIABLE = re.compile(r"\$\{([^}]*)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_path(value: object) -> object:
    """`value` with each `${NAME}` replaced by the environment variable NAME and a leading
    `~` (or `~user`) by the home folder. Raises `ValueError` naming the variable when one is
    not set (or `${...}` does not hold a variable name); values that are not text are left
    for the path type to refuse."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str):
        return value

    def variable(match: re.Match[str]) -> str:
        name = match.group(1)
        if not _NAME.fullmatch(name):
            raise ValueError(f"${{{name}}} is not a variable name (letters, digits, '_')")
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set (used as ${{{name}}} "
                             f"in {value!r})")
        return os.environ[name]

    return os.path.expanduser(_VARIABLE.sub(variable, value))


ConfigPath = Annotated[Path, BeforeValidator(expand_path)]
"""A path setting: `${VAR}` and `~` are expanded when the config is validated."""
