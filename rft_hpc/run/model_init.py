"""The tiny models that `model.init` builds, their vocabulary learned from the run's own text.

A tiny chat model whose spec has `merges` (`tiny-mistral-2layer`, the tool recipe's) gets a
BPE tokenizer as real models have, its merges learned from the run's own text as the
model will read it: the training prompts rendered in the chat template, tools and
demonstrations included, and the rows of the offline data files its stages train on
(preference pairs, demonstrations). A real tokenizer writes such text in about a third of
the tokens that one token per byte takes; a tiny model learns to copy across a prompt that
short far sooner, and a reward model that reads each word as one token tells good words
from bad ones within a pass over its pairs (docs/reward-models.md).
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from rft_hpc.config import ExperimentConfig
from rft_hpc.config.workflow import MultiTurnWorkflow
from rft_hpc.envs.tool_demos import tool_demonstrations
from rft_hpc.models.tiny import INIT_KINDS, TinyModelSpec, init_chat_tokenizer, init_tiny_model
from rft_hpc.tasks.data_check import offline_sources
from rft_hpc.tasks.offline_rows import load_offline_examples
from rft_hpc.tasks.prompts import prompt_text
from rft_hpc.tasks.source import build_tasks

CORPUS_TASKS = 500
"""Training tasks whose renderings the merges are learned from (the rest add no new words)."""


def init_model(config: ExperimentConfig, path: Path, seed: int | None = None) -> Path:
    """Build the tiny model that `config.model.init` names at `path`, its weights drawn with
    `seed` (default: the kind's own, 0), and return `path`. The same config and seed always
    build the same model."""
    assert config.model.init is not None
    spec = INIT_KINDS[config.model.init]
    if seed is not None:
        spec = replace(spec, seed=seed)
    corpus = vocab_corpus(config, spec) if spec.merges else []
    return init_tiny_model(path, spec, corpus)


def vocab_corpus(config: ExperimentConfig, spec: TinyModelSpec) -> list[str]:
    """The texts that `spec`'s merges are learned from: the first `CORPUS_TASKS` training
    tasks of `config`, each rendered as the model reads it (with `prompt.tools` and a
    multi-turn workflow, its demonstration of tool use; else its prompt and answer), and the
    first `CORPUS_TASKS` rows of each offline data file a stage trains on (its prompt with
    each of its responses), rendered by a one-token-per-byte tokenizer of the same family
    (built alone: no model)."""
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        init_chat_tokenizer(Path(tmp), replace(spec, merges=0))
        tokenizer = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    train, _ = build_tasks(config.tasks, config.run.seed)
    train = train[:CORPUS_TASKS]
    flow = config.explorer.workflow
    if config.prompt.tools and isinstance(flow, MultiTurnWorkflow):
        corpus = [tokenizer.decode(demo.tokens)
                  for demo in tool_demonstrations(train, tokenizer, config.prompt, flow)]
    else:
        corpus = [prompt_text(tokenizer, task, config.prompt) + str(task.answer)
                  for task in train]
    for _, data in offline_sources(config):
        examples = load_offline_examples(data.file_source(), data.kind, layout=data.layout)
        corpus += [prompt_text(tokenizer, example.prompt, config.prompt) + response
                   for example in examples[:CORPUS_TASKS] for response in example.responses]
    return corpus
