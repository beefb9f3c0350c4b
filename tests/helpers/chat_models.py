"""Tiny chat models for the prompt-format tests: the tiny Llama with a printable-character
tokenizer, ChatML's `<|im_start|>` / `<|im_end|>` and a ChatML chat template, where the
end-of-turn token `<|im_end|>` is not the tokenizer's EOS (`</s>`) but is listed in
generation_config.json (the case of a base model given a chat template); and the
families of `rft-hpc model init tiny --arch`.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_model(folder: Path, arch: str = "llama") -> Path:
    """A tiny chat model folder in `folder` (built once): `llama` is the ChatML Llama of
    this module; `llama3`, `qwen2`, `qwen3`, `mistral` are `rft-hpc model init tiny`'s chat
    models of that family (their own templates and special tokens)."""
    if (folder / "config.json").is_file():
        return folder
    if arch == "llama":
        return _llama_chatml(folder)
    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

    spec = TinyModelSpec(chat=True) if arch == "llama3" else TinyModelSpec(arch=arch)
    return init_tiny_model(folder, spec)


def _llama_chatml(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model
    from rft_hpc.models.tokenizer import PRINTABLE

    init_tiny_model(folder, TinyModelSpec(alphabet=PRINTABLE))
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = [end, tok.eos_token_id]
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def end_of_turn_id(folder: Path) -> int:
    """The first id of generation_config.json's eos_token_id that is not the tokenizer's EOS."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(folder), local_files_only=True).eos_token_id
    ids = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    ids = [ids] if isinstance(ids, int) else ids
    return next(i for i in ids if i != eos)
