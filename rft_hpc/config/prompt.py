"""Configuration of the prompt format: how a task becomes the prompt's token ids."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rft_hpc.core.config_section import ConfigSection


class PromptConfig(ConfigSection):
    """How every role turns a task into prompt tokens (explorers, trainer, evaluation: the
    same ids everywhere; docs/prompts.md)."""

    format: Literal["raw", "chat"] = "raw"
    """`raw`: the task's prompt string, tokenized with the tokenizer's special tokens (tasks
    with `messages` are refused); `chat`: the task's messages (or its prompt as one user
    message) through the tokenizer's chat template, which the model folder must have."""

    system_prompt: str | None = None
    """With format chat: a system message put before the task's messages (unless they begin
    with a system message of their own)."""

    add_generation_prompt: bool = True
    """With format chat: end the prompt with the template's opening of the assistant's turn
    (what instruction-tuned models expect before they answer)."""

    tools: list[str] = Field(default_factory=list)
    """With format chat: the tools the policy may call, each `package.module:function`.
    Their JSON schemas (from each function's signature and docstring) go to the chat
    template's `tools` argument in every role's prompts; a multi-turn workflow runs the
    calls (docs/multi-turn.md)."""

    @model_validator(mode="after")
    def _chat_settings_need_chat(self) -> PromptConfig:
        if self.format == "raw" and self.system_prompt is not None:
            raise ValueError("system_prompt needs format: chat (a raw prompt has no roles)")
        if self.format == "raw" and self.tools:
            raise ValueError("tools need format: chat (the chat template tells the model "
                             "about them)")
        for spec in self.tools:
            if ":" not in spec:
                raise ValueError(f"tool {spec!r}: write package.module:function")
        return self
