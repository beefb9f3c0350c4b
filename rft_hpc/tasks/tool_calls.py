"""Tools a policy may call, and its calls read out of a turn in its model family's syntax.

A tool is a Python function named `package.module:function`; its JSON schema (what the chat
template's `tools` argument takes) comes from its signature and its docstring's `Args:`
section (`transformers.utils.get_json_schema`). A turn's calls are parsed in one of the
syntaxes the families were trained on:

- `hermes` (Qwen2 / Qwen2.5, Qwen3): one `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` block per call, anywhere in the turn;
- `llama3` (Llama 3.1 / 3.2 JSON tool calling): the whole turn is one JSON object
  `{"name": ..., "parameters": {...}}`, after an optional `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` and a JSON list of `{"name": ..., "arguments": {...}}`.

A call that cannot be read (bad JSON, no name, arguments that are not an object) is kept as
malformed with the reason, for the environment to answer and the metrics to count.
`format_tool_calls` is the inverse: calls written as the family's template writes them (the
assistant turns of tool-use demonstrations).
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rft_hpc.core.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Syntax = Literal["hermes", "llama3", "mistral"]
SYNTAX_MARKERS: dict[Syntax, tuple[str, ...]] = {
    "hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
    "llama3": ("<|python_tag|>", "<|start_header_id|>ipython")}
"""Tokens or template text of each syntax, by which `tool_syntax` knows a tokenizer's."""

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """A policy turn read for tool calls."""

    content: str
    """The turn's text outside its calls."""
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    """Why each call that could not be read failed, in order."""


def parse_tool_calls(text: str, syntax: Syntax) -> ParsedTurn:
    """The calls in a turn's decoded text (special tokens kept) in `syntax`."""
    if syntax == "hermes":
        blocks = _HERMES.findall(text)
        return _read(_HERMES.sub("", text).strip(), blocks, "arguments")
    if syntax == "mistral":
        head, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            return ParsedTurn(text.strip())
        try:
            listed = json.loads(rest.strip())
        except json.JSONDecodeError as exc:
            return ParsedTurn(head.strip(), malformed=[f"not JSON: {exc}"])
        if not isinstance(listed, list):
            return ParsedTurn(head.strip(), malformed=["[TOOL_CALLS] is not a JSON list"])
        return _read(head.strip(), listed, "arguments")
    body = text.replace("<|python_tag|>", "").strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip())
    return _read("", [body], "parameters")


def format_tool_calls(calls: list[ToolCall], syntax: Syntax, content: str = "") -> str:
    """A turn's text that makes `calls` (after `content`, when given) in `syntax`, as the
    family's chat template writes an assistant's calls; `parse_tool_calls` reads it back to
    the same calls and content. `llama3` takes exactly one call and no content."""
    if syntax == "hermes":
        blocks = "".join(
            "\n<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments})
            + "\n</tool_call>" for c in calls)
        return content + blocks if content else blocks.lstrip("\n")
    if syntax == "mistral":
        listed = json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])
        return f"{content}[TOOL_CALLS] {listed}"
    if len(calls) != 1 or content:
        raise ValueError("llama3 tool calling makes one call per turn, with no other text")
    return json.dumps({"name": calls[0].name, "parameters": calls[0].arguments})


def _read(content: str, raw_calls: list[Any], arguments_key: str) -> ParsedTurn:
    turn = ParsedTurn(content)
    for raw in raw_calls:
        try:
            call = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as exc:
            turn.malformed.append(f"not JSON: {exc}")
            continue
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get(arguments_key, call.get("arguments", {})) \
            if isinstance(call, dict) else None
        if not isinstance(name, str) or not name:
            turn.malformed.append("a call without a tool name")
        elif not isinstance(arguments, dict):
            turn.malformed.append(f"the arguments of {name} are not a JSON object")
        else:
            turn.calls.append(ToolCall(name, arguments))
    return turn


def tool_syntax(tokenizer: PreTrainedTokenizerBase) -> Syntax:
    """The tool-call syntax of a tokenizer's family: the first whose marker its vocabulary
    holds as a token or its chat template writes (UserError when none)."""
    vocab = tokenizer.get_vocab()
    template = str(getattr(tokenizer, "chat_template", None) or "")
    for syntax, markers in SYNTAX_MARKERS.items():
        if any(m in vocab or m in template for m in markers):
            return syntax
    raise UserError("the model's tokenizer has none of the tool-call tokens "
                    f"({', '.join(m for ms in SYNTAX_MARKERS.values() for m in ms)}): set the "
                    "tool syntax in the config")


def load_tool(spec: str) -> Callable[..., Any]:
    """The function `package.module:function` names (UserError when it cannot be loaded)."""
    module_name, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name) if name else None
    except (ImportError, AttributeError) as exc:
        raise UserError(f"tool {spec!r} cannot be loaded: {exc}") from exc
    if not callable(fn):
        raise UserError(f"tool {spec!r} is not a function (write package.module:function)")
    return fn


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema a chat template takes for `fn`, from its signature and docstring
    (UserError naming what is missing: a type hint, an argument's description)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers' own errors name the argument that lacks a hint
        raise UserError(f"tool {fn.__module__}:{fn.__name__}: {exc}") from exc


@functools.cache
def tool_schemas(specs: tuple[str, ...]) -> list[dict[str, Any]]:
    """The JSON schemas of the tools `specs` names (`prompt.tools`), in order; loaded once
    per process."""
    return [tool_schema(load_tool(spec)) for spec in specs]
