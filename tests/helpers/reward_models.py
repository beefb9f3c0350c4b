"""Tiny reward models built locally: a tiny chat model of `rft-hpc model init tiny` with a
one-label sequence-classification head (random, seeded), saved as a Hugging Face folder;
and a broken one whose tokenizer has a token the model has no embedding for."""

from __future__ import annotations

from pathlib import Path


def reward_model(folder: Path, arch: str = "qwen2", *, seed: int = 0) -> Path:
    """A tiny one-label `...ForSequenceClassification` folder in `folder` (built once),
    with a pad token id set (what batched scoring needs); `arch` `llama` is the character
    Llama without a chat template, the others chat models with their family's template."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

    base = folder.with_name(folder.name + "-base")
    init_tiny_model(base, TinyModelSpec(seed=seed) if arch == "llama"
                    else TinyModelSpec(arch=arch, seed=seed))
    tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(seed)  # the new score head's weights
    model = AutoModelForSequenceClassification.from_pretrained(
        str(base), num_labels=1, local_files_only=True, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


BROKEN_TOKEN = "<|no_embedding|>"
"""A token of the broken reward model's tokenizer beyond its embedding table."""


def broken_reward_model(folder: Path, good: Path) -> Path:
    """`good` with `BROKEN_TOKEN` added to its tokenizer only: a text holding it makes the
    forward raise (an index past the embeddings), other texts score as `good` does."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(good, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": [BROKEN_TOKEN]})
    tokenizer.save_pretrained(str(folder))
    return folder
