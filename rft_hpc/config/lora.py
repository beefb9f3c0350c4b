"""`model.lora`: train a LoRA adapter on the frozen model instead of the whole model.

The torch trainer builds the adapter with the `peft` library; published weights versions are
the adapter alone (docs/lora.md, docs/weights-format.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rft_hpc.core.config_section import ConfigSection


class LoraSettings(ConfigSection):
    """A LoRA adapter (peft's `LoraConfig`) on the frozen policy model."""

    rank: int = Field(8, ge=1, le=512)
    """Rank `r` of each adapter's low-rank update (peft's `r`; vLLM serves ranks up to
    512)."""

    alpha: float = Field(16.0, gt=0.0)
    """Scale of the update: the adapter adds `alpha / rank x B A` to a layer's weight (peft's
    `lora_alpha`)."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on an adapter's input while training (peft's `lora_dropout`); 0 makes the
    trainer's log-probs those of the explorers."""

    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Which linear layers get an adapter: `all-linear` (every linear layer of the
    transformer blocks, not the output layer), or names of modules as peft matches them
    (e.g. `[q_proj, v_proj]`: every module whose name ends so)."""

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module, or all-linear")
        return value
