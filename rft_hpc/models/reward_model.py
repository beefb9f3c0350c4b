"""Reward models: Hugging Face sequence-classification models with one output, the score of
a whole sequence (prompt and response), read at its last token that is not padding.

A reward-model stage starts from a causal LM folder (the trunk is kept, a new head added)
or from a reward model folder (its head kept); what it publishes and exports is the same
kind of folder, which `AutoModelForSequenceClassification.from_pretrained` loads as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

HEAD = "score"
"""The head's module name in transformers' `*ForSequenceClassification` models (Llama,
Mistral, Qwen2, Qwen3 and most others)."""


def is_reward_model_folder(path: str | Path) -> bool:
    """Whether the model folder at `path` was saved as a sequence-classification model with
    one label (its config.json's architecture and label count)."""
    import json

    config = json.loads((Path(path) / "config.json").read_text())
    architectures = config.get("architectures") or []
    labels = config.get("num_labels", len(config.get("id2label") or {0: 0, 1: 1}))
    return any(a.endswith("ForSequenceClassification") for a in architectures) and labels == 1


def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32,
                      ) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """Tokenizer and one-output sequence-classification model of the local folder `path`
    (never a hub), on the CPU: a reward model folder with its head, or a causal LM's trunk
    with a new head that starts at zero (every score 0, the same for every seed). The
    config's `pad_token_id` is the padding the scores are read past: the tokenizer's pad
    token, else its EOS."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    fresh = not is_reward_model_folder(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a causal LM's unused LM head and the new one
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path), num_labels=1, local_files_only=True, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    if fresh:
        torch.nn.init.zeros_(getattr(model, HEAD).weight)
    model.config.pad_token_id = score_pad_id(tokenizer)
    return tokenizer, model


def score_pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The padding a reward model's scores are read past: the tokenizer's pad token, else
    its EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    return int(pad)


def reward_model_config(config: dict[str, Any], pad_id: int) -> dict[str, Any]:
    """config.json of the reward model made from the causal LM whose config.json is
    `config`: its `*ForSequenceClassification` architecture, one label, `pad_id`."""
    architectures = [a.replace("ForCausalLM", "ForSequenceClassification")
                     for a in config.get("architectures") or []]
    return {**config, "architectures": architectures, "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0}, "pad_token_id": pad_id}


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of `rows` padded on the right with `pad_id`."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask


def sequence_scores(model: torch.nn.Module, rows: Sequence[Sequence[int]], pad_id: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows] float32 scores of token `rows` (each a whole prompt and response) in one
    batched forward of `model`; differentiable unless called under `torch.no_grad`."""
    ids, mask = pad_rows(rows, pad_id)
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    return out.logits[:, 0].float()
