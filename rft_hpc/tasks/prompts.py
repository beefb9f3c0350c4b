"""A task's prompt as token ids, and the tokens that end a response: the one place every
role (explorer engines, trainer, offline SFT data, evaluation) builds them, so that all of
them see exactly the same ids for the same task (docs/prompts.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from rft_hpc.config.prompt import PromptConfig
from rft_hpc.core.errors import UserError
from rft_hpc.tasks.task import Task
from rft_hpc.tasks.tool_calls import tool_schemas

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_messages(task: Task, fmt: PromptConfig) -> list[dict[str, str]]:
    """The messages a chat prompt renders: the task's own (or its prompt as one user
    message), after `fmt.system_prompt` unless the task begins with a system message."""
    messages = [dict(m) for m in task.messages] if task.messages is not None else [
        {"role": "user", "content": task.prompt}]
    if fmt.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
        messages.insert(0, {"role": "system", "content": fmt.system_prompt})
    return messages


def prompt_text(tokenizer: PreTrainedTokenizerBase, task: Task, fmt: PromptConfig) -> str:
    """The prompt as text: the raw prompt, or the chat template rendered over
    `chat_messages` (with the generation prompt when `fmt.add_generation_prompt`)."""
    if fmt.format == "raw":
        if task.messages is not None:
            raise UserError(f"task {task.task_id} has chat messages: set prompt.format: chat "
                            "(a raw prompt is one string)")
        return task.prompt
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("prompt.format is chat, but the model's tokenizer has no chat "
                        "template (tokenizer_config.json chat_template): use format raw or a "
                        "model folder with a template")
    tools = tool_schemas(tuple(fmt.tools)) or None
    return tokenizer.apply_chat_template(chat_messages(task, fmt), tools=tools, tokenize=False,
                                         add_generation_prompt=fmt.add_generation_prompt)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, task: Task, fmt: PromptConfig) -> list[int]:
    """The prompt's token ids. Raw text is tokenized with the tokenizer's special tokens
    (BOS where it adds one); a rendered chat template carries its own, so it is tokenized
    without adding any (as `apply_chat_template(tokenize=True)` does)."""
    text = prompt_text(tokenizer, task, fmt)
    special = fmt.format == "raw"
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: int | Iterable[int] | None,
                   fmt: PromptConfig | None = None) -> list[int]:
    """Token ids that end a response, each once: with format chat the template's
    end-of-turn token first (`end_of_turn_id`), then the tokenizer's EOS, then the model's
    generation config `eos_token_id` (one id or a list: chat models list their end-of-turn
    tokens there, e.g. Qwen2.5's `<|im_end|>` and `<|endoftext|>`)."""
    ids: list[int] = []
    if fmt is not None and fmt.format == "chat":
        end = end_of_turn_id(tokenizer)
        ids += [] if end is None else [end]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if isinstance(generation_eos, int):
        generation_eos = [generation_eos]
    ids += [int(i) for i in generation_eos or []]
    if not ids:
        raise UserError("the model has no EOS token (tokenizer eos_token nor "
                        "generation_config.json eos_token_id): responses could never end")
    return list(dict.fromkeys(ids))


_PROBE = "rft-hpc end-of-turn probe"


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant message's
    content (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...), or None when it writes none."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}],
        tokenize=False)
    at = text.rfind(_PROBE)
    if at < 0:
        return None
    after = list(tokenizer(text[at + len(_PROBE):], add_special_tokens=False)["input_ids"])
    special = set(getattr(tokenizer, "all_special_ids", ()))
    return int(after[0]) if after and after[0] in special else None


def model_stop_ids(model_path: str | Path, tokenizer: PreTrainedTokenizerBase,
                   fmt: PromptConfig | None = None) -> list[int]:
    """`stop_token_ids` of a model folder: with its generation_config.json `eos_token_id`,
    else its config.json one (what transformers' `model.generation_config` holds)."""
    for name in ("generation_config.json", "config.json"):
        file = Path(model_path) / name
        if file.is_file():
            eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
            if eos is not None:
                return stop_token_ids(tokenizer, eos, fmt)
    return stop_token_ids(tokenizer, None, fmt)


def response_ids(tokenizer: PreTrainedTokenizerBase, text: str, stop_ids: list[int]) -> list[int]:
    """A response the model should produce (an SFT answer, a DPO choice): its tokens without
    special tokens, then the first of `stop_ids` (`stop_token_ids`: with format chat the
    template's end-of-turn token, else the tokenizer's EOS)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + stop_ids[:1]


def truncate_at_stop(tokens: list[int], stop_ids: Iterable[int]) -> tuple[list[int], bool]:
    """`tokens` up to and including the first stop token, and whether there was one."""
    stops = set(stop_ids)
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1], True
    return tokens, False
