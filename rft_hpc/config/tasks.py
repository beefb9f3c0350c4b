"""Configuration of the task source: generated arithmetic or the user's JSONL task files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from rft_hpc.core.config_section import ConfigSection


class ArithmeticTasks(ConfigSection):
    """Generated problems `a<op>b=` with an exact-match answer reward."""

    type: Literal["arithmetic"] = "arithmetic"
    """Selects generated arithmetic tasks."""

    digits: int = Field(2, ge=1, le=3)
    """Digits of each operand (2: 10..99)."""

    ops: str = Field("+", pattern=r"^[+\-*]+$")
    """Operators to generate problems for, e.g. `+` or `+-`."""

    eval_size: int = Field(500, ge=1)
    """Problems held out for evaluation (never trained on)."""

    reward: str = "exact_match"
    """Reward function: a registered name or `package.module:function`."""


class JsonlTasks(ConfigSection):
    """Tasks from JSONL files: one `{"prompt": ..., "answer": ...}` object per line."""

    type: Literal["jsonl"] = "jsonl"
    """Selects task files."""

    path: Path
    """Training tasks (JSONL)."""

    eval_path: Path | None = None
    """Held-out evaluation tasks (JSONL); none means no evaluation."""

    reward: str | None = None
    """Reward function for lines that name none (default `exact_match`)."""


TasksConfig = Annotated[ArithmeticTasks | JsonlTasks, Field(discriminator="type")]
