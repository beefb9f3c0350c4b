"""The base of every config section (outside `rft_hpc.config`, which imports them all)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigSection(BaseModel):
    """A strict config section: an unknown key is an error, and the docstring under each
    field is its description (what `docs/config.md` and error messages show)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
