"""The chat templates of the tiny chat models, one per family, in that family's own style.

Each is a Jinja template as Hugging Face tokenizers keep it (`chat_template` in
tokenizer_config.json), written after the family's published template with tool calls left
out: `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` renders a
conversation the way the real model of that family expects it.
"""

from __future__ import annotations

QWEN2 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2 / Qwen2.5 (ChatML): a default system message when none is given."""

QWEN3 = (
    "{%- set ns = namespace(last_query=messages|length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if not ns.found and message['role'] == 'user' %}"
    "{%- set ns.found = true %}{%- set ns.last_query = messages|length - 1 - loop.index0 %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content"
    " + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
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
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
"""Llama 3 Instruct: a header per turn, each turn closed by `<|eot_id|>`."""

MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in turns %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...')"
    " }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system %}"
    "{{- '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- else %}{{- message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)
"""Mistral Instruct: `[INST] ... [/INST]` around each user turn (a system message goes
into the first), each answer closed by `</s>`; the generation prompt is `[/INST]` itself."""
