"""Task sources in the formats people have: JSONL, Parquet and `datasets` folders, through a
key mapping, with splits and row ranges; bad rows named by file and row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.data_files import datasets_folder

from rft_hpc.config.tasks import FileTasks
from rft_hpc.core.errors import UserError
from rft_hpc.tasks.source import build_tasks

GSM8K = {"question": [f"What is {i} + {i}?" for i in range(6)],
         "answer": [f"{i} and {i} make {2 * i}.\n#### {2 * i}" for i in range(6)],
         "level": list(range(6))}


def _parquet(path, columns):
    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_with_gsm8k_columns_a_row_range_and_extra_columns_in_info(tmp_path):
    path = _parquet(tmp_path / "gsm8k.parquet", GSM8K)
    train, held_out = build_tasks(FileTasks(path=path, keys={"prompt": "question"},
                                            rows=[0, 4], eval_rows=[4, 6]), 0)
    assert [t.prompt for t in train] == GSM8K["question"][:4]
    assert [t.answer for t in train] == GSM8K["answer"][:4]
    assert [t.info for t in train] == [{"level": i} for i in range(4)]
    assert [t.task_id for t in held_out] == ["gsm8k-4", "gsm8k-5"]
    assert held_out[1].answer.endswith("#### 10") and train[0].messages is None


def test_a_datasets_folder_with_math_columns_and_two_splits(tmp_path):
    math = {"problem": ["Compute 1+1.", "Compute 2+2."], "solution": ["$\\boxed{2}$", "4"],
            "type": ["Algebra", "Prealgebra"]}
    path = datasets_folder(tmp_path / "math", {"train": math, "test": {
        k: v[:1] for k, v in math.items()}})
    source = FileTasks(path=path, split="train", eval_split="test",
                       keys={"prompt": "problem", "answer": "solution"}, reward="exact_match")
    train, held_out = build_tasks(source, 0)
    assert [(t.prompt, t.answer, t.info) for t in train] == [
        ("Compute 1+1.", "$\\boxed{2}$", {"type": "Algebra"}),
        ("Compute 2+2.", "4", {"type": "Prealgebra"})]
    assert [t.task_id for t in held_out] == ["math-test-0"]
    with pytest.raises(UserError, match="holds the splits train, test: choose one"):
        build_tasks(FileTasks(path=path, keys=source.keys), 0)
    with pytest.raises(UserError, match=r"has no split 'dev' \(splits: train, test\)"):
        build_tasks(FileTasks(path=path, split="dev", keys=source.keys), 0)


def test_chat_messages_from_jsonl_and_other_keys_into_info(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "2+2?"}], "answer": 4, "src": "x",
             "id": "q1"},
            {"messages": [{"role": "user", "content": "3+3?"}], "answer": "6", "src": "y",
             "id": "q2"}]
    path.write_text("".join(json.dumps(r) + "\n\n" for r in rows))
    (train, _) = build_tasks(FileTasks(path=path, keys={"task_id": "id"}), 0)
    assert [t.messages for t in train] == [rows[0]["messages"], rows[1]["messages"]]
    assert [(t.task_id, t.prompt, t.answer, t.info) for t in train] == [
        ("q1", "", "4", {"src": "x"}), ("q2", "", "6", {"src": "y"})]


def test_the_old_jsonl_form_still_reads(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text('{"prompt": "q1", "answer": "a1", "reward": "exact_match", "taskset": "t",'
                    ' "info": {"k": 1}}\n')
    (task,), _ = build_tasks(FileTasks.model_validate({"type": "jsonl", "path": path}), 0)
    assert (task.task_id, task.taskset, task.info) == ("old-1", "t", {"k": 1})


@pytest.mark.parametrize(("columns", "keys", "message"), [
    (GSM8K, {}, "gsm8k.parquet: no column 'prompt' (or 'messages') for the prompt; the "
                "columns there are: question, answer, level"),
    ({"question": GSM8K["question"], "answer": [1.5] * 6}, {"prompt": "question"},
     "gsm8k.parquet, row 0: column 'answer' holds a number, expected a string"),
    ({"question": ["a", None], "answer": ["1", "2"]}, {"prompt": "question"},
     "gsm8k.parquet, row 1: column 'question' holds null, expected a string"),
])
def test_bad_sources_name_file_row_column_and_type(tmp_path, columns, keys, message):
    path = _parquet(tmp_path / "gsm8k.parquet", columns)
    with pytest.raises(UserError) as info:
        build_tasks(FileTasks(path=path, keys=keys), 0)
    assert message in str(info.value)


def test_a_bad_jsonl_row_names_its_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "q", "answer": "a"}\n\n{"prompt": ["q"], "answer": "a"}\n')
    with pytest.raises(UserError, match=r"t.jsonl, line 3: column 'prompt' holds a list"):
        build_tasks(FileTasks(path=path), 0)
    path.write_text('{"prompt": "q", "answer": "a"}\n{"prompt": "q"}\n')
    with pytest.raises(UserError, match=r"line 2: no column 'answer' \(the row has: prompt\)"):
        build_tasks(FileTasks(path=path), 0)


def test_unknown_formats_and_out_of_range_rows_are_refused(tmp_path):
    (tmp_path / "t.csv").write_text("prompt,answer\n")
    with pytest.raises(UserError, match="unknown data format"):
        build_tasks(FileTasks(path=tmp_path / "t.csv"), 0)
    (tmp_path / "folder").mkdir()
    with pytest.raises(UserError, match="not one written by datasets' save_to_disk"):
        build_tasks(FileTasks(path=tmp_path / "folder"), 0)
    path = _parquet(tmp_path / "g.parquet", {"prompt": ["a"], "answer": ["b"]})
    with pytest.raises(UserError, match=r"holds no rows in rows \[5, 9\)"):
        build_tasks(FileTasks(path=path, rows=[5, 9]), 0)
    with pytest.raises(ValueError, match="0 <= start < stop"):
        FileTasks(path=path, rows=[3, 1])
    with pytest.raises(ValueError, match="eval_rows overlap the training rows"):
        FileTasks(path=path, rows=[0, 5], eval_rows=[4, 6])


def test_a_frozen_config_that_writes_every_key_reads_the_same_columns(tmp_path):
    """A role reads its stage's frozen config, which spells out every key at its default:
    the source must pick the same columns as from the user's config."""
    path = _parquet(tmp_path / "gsm8k.parquet", GSM8K)
    source = FileTasks(path=path, keys={"prompt": "question"}, rows=[0, 4], eval_rows=[4, 6])
    frozen = FileTasks.model_validate(source.model_dump(mode="json"))
    assert build_tasks(frozen, 0) == build_tasks(source, 0)
    assert [t.prompt for t in build_tasks(frozen, 0)[0]] == GSM8K["question"][:4]
