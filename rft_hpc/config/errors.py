"""`ConfigError`: every problem of a config file at once, each with its file, key and line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rft_hpc.core.errors import UserError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config, and where: a line of the file or a `--set` override."""

    file: Path
    """The config file."""

    message: str
    """What is wrong, in plain words."""

    key: str = ""
    """Dotted key path (`trainer.lr`); empty when the problem is not about one key."""

    line: int | None = None
    """1-based line in `file` where the key (or the nearest enclosing key) appears."""

    column: int | None = None
    """1-based column, for YAML syntax errors."""

    override: str | None = None
    """The `--set KEY=VALUE` text the key or value came from, instead of a line of the file."""

    def __str__(self) -> str:
        head = str(self.file)
        if self.line is not None:
            head += f":{self.line}"
            if self.column is not None:
                head += f":{self.column}"
        parts = [head]
        if self.key:
            parts.append(self.key + (f" (from --set {self.override})" if self.override else ""))
        elif self.override is not None:
            parts.append(f"--set {self.override}")
        parts.append(self.message)
        return ": ".join(parts)


class ConfigError(UserError):
    """A config that cannot be used: `problems` holds every problem found, and the message
    shows them one per line, in the order given."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        if not problems:
            raise ValueError("ConfigError needs at least one problem")
        self.problems: tuple[Problem, ...] = tuple(problems)
        lines = [str(p) for p in self.problems]
        if len(lines) == 1:
            message = lines[0]
        else:
            message = f"{len(lines)} problems in the config:\n" + "\n".join(
                f"  {line}" for line in lines
            )
        super().__init__(message)
