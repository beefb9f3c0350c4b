"""A reward model's held-out evaluation: pairwise accuracy on preference pairs it never
trained on (`data`'s held-out rows, or with `data.source: tasks` the task source's eval
split, each answer chosen over a wrong one).

Like `HeldOutEvaluation` it keeps a whole replica of the model (built at first use) and
loads the weights it is given into it, so the model being trained is never touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rft_hpc.buffer.offline import example_records, task_records
from rft_hpc.buffer.records import DPOPair
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import write_jsonl
from rft_hpc.models.reward_model import load_reward_model, sequence_scores
from rft_hpc.tasks.offline_rows import load_offline_examples
from rft_hpc.tasks.prompts import model_stop_ids
from rft_hpc.tasks.source import build_tasks

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def heldout_pairs(config: ExperimentConfig,
                  tokenizer: PreTrainedTokenizerBase) -> list[DPOPair]:
    """The stage's held-out preference pairs, tokenized as its training pairs are (the same
    prompt format and stop token); empty when it holds none out."""
    data = config.data
    if data is None or data.source == "jsonl":
        return []
    stops = model_stop_ids(config.model.path, tokenizer, config.prompt)
    if data.source == "file":
        source = data.eval_source()
        if source is None:
            return []
        examples = load_offline_examples(source, "dpo", layout=data.layout)
        records = example_records(examples, tokenizer,
                                  prompt_format=config.prompt, stop_ids=stops)
    else:
        _, held_out = build_tasks(config.tasks, config.run.seed)
        records = task_records(held_out, tokenizer, "dpo", config.run.seed,
                               prompt_format=config.prompt, stop_ids=stops)
    return [r for r in records if isinstance(r, DPOPair)]


class PairwiseEvaluation:
    """Scores a reward model's weights on the held-out pairs: `eval_accuracy` (the share
    whose chosen response scores higher), `eval_reward_gap` (mean r_chosen - r_rejected)."""

    def __init__(self, config: ExperimentConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.tasksets: dict[str, list] = {}
        """No task sets: a reward model is scored on its pairs alone."""
        self._tokenizer, self._model = load_reward_model(config.model.path)
        self._model.to(device).eval()
        self.pairs = heldout_pairs(config, self._tokenizer)

    @property
    def enabled(self) -> bool:
        """True when the stage holds pairs out: only then does the trainer evaluate."""
        return bool(self.pairs)

    def score(self, weights: Mapping[str, torch.Tensor], version: int,
              answers: Path) -> dict[str, float]:
        """The held-out scores of `weights` (the reward model's full state dict); each
        pair's scores go to `answers` (JSONL in pair order: `task_id`, `chosen`,
        `rejected`, `correct`). The same weights always score the same. `version` is
        the weights' trainer step, unused here."""
        del version
        self._model.load_state_dict(dict(weights))
        pad = int(self._model.config.pad_token_id)
        batch = max(1, self.config.eval.batch_size // 2)
        chosen: list[float] = []
        rejected: list[float] = []
        with torch.no_grad():
            for i in range(0, len(self.pairs), batch):
                part = self.pairs[i:i + batch]
                rows = [p.chosen_tokens.tolist() for p in part] + \
                    [p.rejected_tokens.tolist() for p in part]
                scores = sequence_scores(self._model, rows, pad, self.device).tolist()
                chosen += scores[:len(part)]
                rejected += scores[len(part):]
        rows_out = [{"task_id": p.task_id, "chosen": c, "rejected": r, "correct": c > r}
                    for p, c, r in zip(self.pairs, chosen, rejected, strict=True)]
        write_jsonl(answers, rows_out)
        n = len(self.pairs)
        return {"eval_accuracy": sum(row["correct"] for row in rows_out) / n,
                "eval_reward_gap": sum(c - r for c, r in zip(chosen, rejected,
                                                               strict=True)) / n}

