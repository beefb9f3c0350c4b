"""Tool calls read out of a policy's turn in each family's syntax, malformed calls kept with
their reason, and a tool's JSON schema from its signature and docstring
(rft_hpc/tasks/tool_calls.py); calls written in each syntax and read back."""

from __future__ import annotations

import pytest

from rft_hpc.core.errors import UserError
from rft_hpc.tasks.tool_calls import (
    ToolCall,
    format_tool_calls,
    load_tool,
    parse_tool_calls,
    tool_schema,
    tool_syntax,
)


def lookup(city: str, year: int = 2020) -> str:
    """Population of a city.

    Args:
        city: The city's name.
        year: The census year.
    """
    return f"{city}:{year}"


def untyped(city):  # a tool without type hints: refused
    """No hints.

    Args:
        city: The city.
    """
    return city


CALL = ToolCall("lookup", {"city": "Oslo"})


@pytest.mark.parametrize(("syntax", "text"), [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n'
               "</tool_call><|im_end|>"),
    ("llama3", '<|python_tag|>{"name": "lookup", "parameters": {"city": "Oslo"}}'),
    ("llama3", '{"name": "lookup", "parameters": {"city": "Oslo"}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "lookup", "arguments": {"city": "Oslo"}}]'),
])
def test_each_familys_syntax_gives_the_call(syntax, text):
    turn = parse_tool_calls(text, syntax)
    assert turn.calls == [CALL] and turn.malformed == []


def test_several_calls_and_the_text_around_them():
    text = ('A <tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call> B '
            '<tool_call>{"name": "lookup", "arguments": {"city": "Rome", "year": 1990}}'
            "</tool_call>")
    turn = parse_tool_calls(text, "hermes")
    assert turn.calls == [CALL, ToolCall("lookup", {"city": "Rome", "year": 1990})]
    assert turn.content == "A  B"
    assert parse_tool_calls("The answer is 42.", "hermes").calls == []
    assert parse_tool_calls("The answer is 42.", "llama3").content == "The answer is 42."
    assert parse_tool_calls("No call.", "mistral").calls == []


ROME = ToolCall("lookup", {"city": "Rome", "year": 1990, "note": "a \"quoted\" <b>"})


@pytest.mark.parametrize(("syntax", "calls", "content"), [
    ("hermes", [CALL], ""), ("hermes", [CALL, ROME], ""), ("hermes", [ROME], "Let me look."),
    ("mistral", [CALL], ""), ("mistral", [CALL, ROME], ""), ("mistral", [ROME], "Look."),
    ("llama3", [CALL], ""), ("llama3", [ROME], ""),
])
def test_calls_written_in_a_syntax_read_back_the_same(syntax, calls, content):
    text = format_tool_calls(calls, syntax, content)
    turn = parse_tool_calls(text, syntax)
    assert turn.calls == calls and turn.content == content and turn.malformed == []


def test_calls_are_written_as_each_familys_template_writes_them():
    assert format_tool_calls([CALL], "hermes") == (
        '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert format_tool_calls([CALL], "mistral") == (
        '[TOOL_CALLS] [{"name": "lookup", "arguments": {"city": "Oslo"}}]')
    assert format_tool_calls([CALL], "llama3") == (
        '{"name": "lookup", "parameters": {"city": "Oslo"}}')
    with pytest.raises(ValueError, match="one call per turn"):
        format_tool_calls([CALL, ROME], "llama3")


@pytest.mark.parametrize(("syntax", "text", "reason"), [
    ("hermes", '<tool_call>{"name": "lookup", "arguments": {"city": </tool_call>', "not JSON"),
    ("hermes", '<tool_call>{"name": "lookup", "arguments": {"city": "Os', "not JSON"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "without a tool name"),
    ("hermes", '<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>', "not a JSON"),
    ("llama3", '{"name": "lookup", "parameters": ', "not JSON"),
    ("mistral", '[TOOL_CALLS] {"name": "lookup"}', "not a JSON list"),
    ("mistral", "[TOOL_CALLS] [{", "not JSON"),
])
def test_malformed_calls_are_kept_with_their_reason(syntax, text, reason):
    turn = parse_tool_calls(text, syntax)
    assert turn.calls == [] and len(turn.malformed) == 1 and reason in turn.malformed[0]


def test_a_tools_schema_comes_from_its_signature_and_docstring():
    schema = tool_schema(load_tool("test_tool_calls:lookup"))
    assert schema["function"]["name"] == "lookup"
    params = schema["function"]["parameters"]
    assert params["properties"]["city"] == {"type": "string", "description": "The city's name."}
    assert params["properties"]["year"]["type"] == "integer"
    assert params["required"] == ["city"]
    with pytest.raises(UserError, match="untyped"):
        tool_schema(untyped)
    with pytest.raises(UserError, match="cannot be loaded"):
        load_tool("no_such_module:fn")
    with pytest.raises(UserError, match="not a function"):
        load_tool("test_tool_calls:CALL")


class _Tokenizer:
    """What `tool_syntax` reads of a tokenizer: its vocabulary and chat template."""

    def __init__(self, vocab: list[str], template: str = "") -> None:
        self.vocab, self.chat_template = vocab, template

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.vocab)}


def test_the_syntax_is_known_by_the_vocabulary_or_the_template():
    assert tool_syntax(_Tokenizer(["a", "[TOOL_CALLS]"])) == "mistral"
    assert tool_syntax(_Tokenizer(["a"], "{{ '<tool_call>' }}")) == "hermes"
    assert tool_syntax(_Tokenizer(["<|python_tag|>"])) == "llama3"
    with pytest.raises(UserError, match="none of the tool-call tokens"):
        tool_syntax(_Tokenizer(["a"], "{{ messages }}"))
