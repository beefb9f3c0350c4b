"""The tiny chat models' templates (rft_hpc/models/chat_templates.py), per family: without
tools a conversation renders as it did before tool use was added (the learning tests' chat
prompts depend on it); with tools, the schemas go where the family puts them, an assistant's
tool calls render in the family's syntax and parse back (tasks/tool_calls.py), and tool
results render alone as the family's tool message (tasks/chat_turns.py)."""

from __future__ import annotations

import pytest
from helpers.chat_models import chat_model
from transformers import AutoTokenizer

from rft_hpc.tasks.chat_turns import ChatTurns
from rft_hpc.tasks.tool_calls import ToolCall, parse_tool_calls, tool_syntax

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
BEFORE_TOOLS = {  # rendered with the templates as they were before tool use (2026-12-06)
    "qwen2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
             "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n"
             "<|im_start|>assistant\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
              "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\n3+3?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "<s>[INST] Be brief.\n\n2+2? [/INST]4</s>[INST] 3+3? [/INST]",
}
BEFORE_TOOLS["qwen3"] = BEFORE_TOOLS["qwen2"]
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Population of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"city": "Oslo"}}}
SYNTAX = {"qwen2": "hermes", "qwen3": "hermes", "llama3": "llama3", "mistral": "mistral"}
RESULT = {"qwen2": "<tool_response>\n700000\n</tool_response>", "llama3": "ipython",
          "mistral": '[TOOL_RESULTS] {"content": "700000"}[/TOOL_RESULTS]'}
RESULT["qwen3"] = RESULT["qwen2"]


@pytest.fixture(scope="module", params=sorted(SYNTAX))
def family(request, tmp_path_factory):
    folder = chat_model(tmp_path_factory.mktemp(f"tpl-{request.param}"), request.param)
    return request.param, AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                   **kwargs)


def test_without_tools_a_conversation_renders_as_before(family):
    name, tok = family
    assert render(tok, CONVERSATION) == BEFORE_TOOLS[name]
    if name == "mistral":
        with pytest.raises(Exception, match="must alternate"):
            render(tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_tools_calls_and_results_in_the_familys_own_format(family):
    name, tok = family
    question = {"role": "user", "content": "People in Oslo?"}
    assert "Population of a city." in render(tok, [question], tools=TOOLS)
    assert "Population of a city." not in render(tok, [question])
    called = tok.apply_chat_template(
        [question, {"role": "assistant", "content": "", "tool_calls": [CALL]}], tools=TOOLS,
        tokenize=False)
    prompt = render(tok, [question], tools=TOOLS)
    assert called.startswith(prompt)
    turns = ChatTurns(tok)
    # the assistant's turn as the policy would write it, up to its end-of-turn token
    answer = called[len(prompt):].partition(tok.decode([turns.end_of_turn]))[0]
    assert tool_syntax(tok) == SYNTAX[name]
    turn = parse_tool_calls(answer, SYNTAX[name])
    assert turn.calls == [ToolCall("lookup", {"city": "Oslo"})] and not turn.malformed
    result = turns.messages([{"role": "tool", "content": "700000"}])
    assert RESULT[name] in tok.decode(result)
