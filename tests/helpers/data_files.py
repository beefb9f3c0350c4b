"""Data files for the data-source tests: Hugging Face `datasets` folders written locally."""

from __future__ import annotations

from pathlib import Path


def datasets_folder(path: Path, splits: dict[str, dict[str, list]]) -> Path:
    """A folder written by `datasets`' `save_to_disk` holding one split per entry of
    `splits` (split name -> columns); returns `path`."""
    import datasets

    datasets.disable_progress_bars()
    datasets.DatasetDict({name: datasets.Dataset.from_dict(cols)
                          for name, cols in splits.items()}).save_to_disk(str(path))
    return path
