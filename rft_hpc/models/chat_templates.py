"""The chat templates of the tiny chat models, one per family, in that family's own style.

Each is a Jinja template as Hugging Face tokenizers keep it (`chat_template` in
tokenizer_config.json), written after the family's published template, tool use included
(the `tools` argument, assistant `tool_calls`, `tool` messages):
`tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True)` renders a
conversation the way the real model of that family expects it. Without tools a conversation
renders exactly as it did before tool use was added (tests/unit/test_chat_templates.py).
"""

from __future__ import annotations

# Qwen's (Hermes-style) tool parts, as Qwen2.5's and Qwen3's published templates write them:
# the tools' JSON schemas in the system message, each call in a <tool_call> block, and the
# results of consecutive tool messages in one user turn of <tool_response> blocks.
_HERMES_TOOLS = (
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
)
_HERMES_TOOL_CALLS = (
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{{- call['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
)
_HERMES_TOOL_RESPONSE = (
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
)

QWEN2 = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n' }}" + _HERMES_TOOLS +
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}" + _HERMES_TOOL_RESPONSE +
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    + _HERMES_TOOL_CALLS +
    "{%- elif not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2 / Qwen2.5 (ChatML): a default system message when none is given; with tools, their
schemas in the system message, calls in `<tool_call>` blocks, results in `<tool_response>`
blocks of one user turn."""

QWEN3 = (
    "{%- set ns = namespace(last_query=messages|length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if not ns.found and message['role'] == 'user' %}"
    "{%- set ns.found = true %}{%- set ns.last_query = messages|length - 1 - loop.index0 %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}" + _HERMES_TOOLS + "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{{- call['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}" + _HERMES_TOOL_RESPONSE +
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
"""Qwen3 (ChatML, no default system message): an assistant turn's `<think>` reasoning is
kept only after the last user message; `enable_thinking=False` opens the answer with an
empty think block."""

LLAMA3 = (
    "{{- bos_token }}"
    "{%- set ns = namespace(tools_placed=false) %}"
    "{%- for message in messages %}"
    "{%- if tools and not ns.tools_placed and message['role'] == 'user' %}"
    "{%- set ns.tools_placed = true %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please "
    "respond with a JSON for a function call with its proper arguments that best answers the "
    "given prompt.\\n\\nRespond in the format {\\\"name\\\": function name, \\\"parameters\\\": "
    "dictionary of argument name and its value}.Do not use variables.\\n\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson(indent=4) + '\\n\\n' }}{%- endfor %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- set call = message['tool_calls'][0] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\\\"name\\\": \\\"' + call['name']"
    " + '\\\", \\\"parameters\\\": ' + call['arguments'] | tojson + '}<|eot_id|>' }}"
    "{%- elif message['role'] in ('tool', 'ipython') %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
"""Llama 3 Instruct: a header per turn, each turn closed by `<|eot_id|>`; with tools (Llama
3.1's JSON tool calling), their schemas in the first user message, a call as the turn's
JSON `{"name", "parameters"}`, results under the `ipython` header."""

MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1, expect_user=true) %}"
    "{%- for message in turns %}{%- if message['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\\\"content\\\": ' + message['content'] | tojson + '}[/TOOL_RESULTS]' }}"
    "{%- set ns.expect_user = false %}"
    "{%- else %}"
    "{%- if message['role'] == 'assistant' and ns.expect_user or message['role'] == 'user' and "
    "not ns.expect_user and not (loop.index0 > 0 and turns[loop.index0 - 1]['role'] == 'tool') %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...')"
    " }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if loop.first and system %}"
    "{{- '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- set ns.expect_user = false %}"
    "{%- elif message.get('tool_calls') %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '{\\\"name\\\": \\\"' + call['name'] + '\\\", \\\"arguments\\\": '"
    " + call['arguments'] | tojson + '}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ']' + eos_token }}{%- set ns.expect_user = true %}"
    "{%- else %}{{- message['content'] + eos_token }}{%- set ns.expect_user = true %}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
)
"""Mistral Instruct: `[INST] ... [/INST]` around each user turn (a system message goes
into the first), each answer closed by `</s>`; the generation prompt is `[/INST]` itself.
With tools (v0.3): `[AVAILABLE_TOOLS]` before the last user turn, calls as `[TOOL_CALLS]` and
a JSON list, results in `[TOOL_RESULTS]` (roles alternate, tool results aside)."""
