"""Configuration of the offline data a `train` stage imports into the buffer: SFT samples
and DPO pairs made from the task source, the user's data files (JSONL, Parquet or a
Hugging Face `datasets` folder, read through a key mapping), or `rft-hpc buffer import`
JSONL (docs/data.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from rft_hpc.config.paths import ConfigPath
from rft_hpc.config.tasks import DataKeys, DataSourceFields, HeldOutFields


class DataConfig(HeldOutFields):
    """Offline data imported into the buffer before a `train` stage starts."""

    source: Literal["tasks", "file", "jsonl"] = "tasks"
    """`tasks`: records made from the task source's training split; `file`: the rows of the
    data file or `datasets` folder at `path` (`split`, `rows`, `keys`), SFT rows a prompt (or
    messages) and a response, DPO rows a prompt (or messages), chosen and rejected (or, in
    `layout` webgpt, a question, two answers and their scores); `jsonl`: the file at
    `path`, as `rft-hpc buffer import` reads it."""

    path: ConfigPath | None = None  # type: ignore[assignment]  # optional here: source tasks
    """With source `file`: a `.jsonl` or `.parquet` file, or a folder written by `datasets`'
    `save_to_disk` (read locally, never from a hub); with source `jsonl`: a file in
    `rft-hpc buffer import`'s layout. `${VAR}` and `~` are expanded."""

    kind: Literal["sft", "dpo", "rl"] = "sft"
    """Record kind: `sft` (a prompt and the response trained on) or `dpo` (a prompt, the
    response chosen and the one rejected; with source tasks the answer chosen over a wrong
    one); `rl` (rollouts) only with source jsonl."""

    layout: Literal["pairs", "webgpt"] = "pairs"
    """How a DPO row holds its pair (source file, kind dpo): `pairs`, a prompt (or
    messages), a chosen and a rejected response (and with `keys.margin` a margin);
    `webgpt`, as WebGPT's comparisons: a question, two answers and a score each (`keys`
    `question`, `answer_0`, `answer_1`, `score_0`, `score_1`), the higher-scored answer
    chosen, the score difference the margin, ties skipped (docs/data.md)."""

    taskset: str | None = None
    """Task-set name given to the imported records (default: their own; with source file the
    row's `taskset` column, else the file's stem). With a `mixture` sampler it sets the share
    of offline (expert) records in each batch, as MIX wants."""

    @model_validator(mode="after")
    def _settings_of_the_source(self) -> DataConfig:
        # Compared with the defaults, not with the keys given: a frozen config (and a stage
        # merged from its base) spells every key out.
        file_only = [name for name, unset in (("split", self.split is None),
                                              ("rows", self.rows is None),
                                              ("keys", self.keys == DataKeys()),
                                              ("layout", self.layout == "pairs"),
                                              ("eval_path", self.eval_path is None),
                                              ("eval_split", self.eval_split is None),
                                              ("eval_rows", self.eval_rows is None))
                     if not unset]
        if self.source == "tasks" and self.path is not None:
            file_only.insert(0, "path")
        if self.source != "file" and file_only:
            raise ValueError(f"{', '.join(file_only)} only apply with source file (source "
                             f"{self.source} reads " + ("the task source)" if self.source ==
                                                        "tasks" else "buffer-import JSONL)"))
        if self.source != "tasks" and self.path is None:
            raise ValueError(f"source {self.source} needs path (the data file)")
        if self.source != "jsonl" and self.kind == "rl":
            raise ValueError(f"kind rl needs source jsonl (source {self.source} has no "
                             "rollouts)")
        if self.layout == "webgpt" and self.kind != "dpo":
            raise ValueError(f"layout webgpt holds preference pairs: it needs kind dpo (not "
                             f"{self.kind})")
        if self.keys.margin is not None and (self.kind != "dpo" or self.layout != "pairs"):
            raise ValueError("keys.margin applies to kind dpo in layout pairs (layout webgpt "
                             "takes the score difference)")
        return self

    def file_source(self) -> DataSourceFields:
        """The data source of source `file` (path, split, rows, keys), as the readers of
        `rft_hpc.tasks` take it."""
        if self.path is None:
            raise ValueError("data.path is not set")
        return DataSourceFields(path=self.path, split=self.split, rows=self.rows,
                                keys=self.keys)
