"""Preference data in the formats people have (`data: {source: file, kind: dpo}`): pairs with
a prompt or chat messages and an optional margin column, and WebGPT's comparisons layout
(a question, two answers, a score each), imported to DPO pairs the way a `train` stage
imports them; ties skipped and counted, bad rows named by file, row and key."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.chat_models import chat_model
from helpers.data_files import datasets_folder

from rft_hpc.buffer.records import DPOPair
from rft_hpc.buffer.segment import read_segment
from rft_hpc.config import ExperimentConfig
from rft_hpc.config.offline_data import DataConfig
from rft_hpc.core.errors import UserError
from rft_hpc.run.stages import OFFLINE_WRITER, prepare_stage
from rft_hpc.tasks.data_check import check_task_sources
from rft_hpc.tasks.offline_rows import load_offline_examples

TALK = [{"role": "user", "content": "Describe the cat."}]
WEBGPT = {  # WebGPT's comparisons: the question a mapping, the scores opposite numbers
    "question": [{"full_text": "Why is the sky blue?", "dataset": "eli5", "id": "q0"},
                 {"full_text": "What is rain?", "dataset": "eli5", "id": "q1"},
                 {"full_text": "Who wrote Hamlet?", "dataset": "eli5", "id": "q2"}],
    "answer_0": ["Scattering.", "Water.", "Shakespeare."],
    "answer_1": ["Paint.", "Falling water.", "Marlowe."],
    "score_0": [1.0, 0.0, 0.5],
    "score_1": [-1.0, 0.0, -0.5],
    "tokens_0": [[1, 2], [3], [4]],
}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2 chat model folder."""
    return chat_model(tmp_path_factory.mktemp("qwen2") / "model", "qwen2")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path, model, **data) -> ExperimentConfig:
    return ExperimentConfig.model_validate({
        "run": {"name": "prefs", "root": str(tmp_path / "runs")}, "model": {"path": str(model)},
        "prompt": {"format": "chat"}, "mode": "train", "algorithm": {"algorithm_type": "dpo"},
        "data": {"source": "file", "kind": "dpo", **data}})


def _imported(tmp_path, model, **data) -> list[DPOPair]:
    """The records a `train` stage imports into its buffer from `data`."""
    run = prepare_stage(_config(tmp_path, model, **data), tmp_path / "stage", None)
    return read_segment(run.buffer / OFFLINE_WRITER / "00000000.h5").records()


def _examples(**data):
    config = DataConfig(source="file", kind="dpo", **data)
    return load_offline_examples(config.file_source(), config.kind, layout=config.layout)


def test_pairs_with_a_margin_column_keep_the_margin_in_info(tmp_path, qwen2):
    path = _jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5", "gap": 2, "src": "a"},
        {"prompt": "3+3?", "chosen": "6", "rejected": "9", "gap": 0.5, "src": "b"}])
    pairs = _imported(tmp_path, qwen2, path=str(path), keys={"margin": "gap"})
    assert all(isinstance(p, DPOPair) for p in pairs)
    assert [p.info for p in pairs] == [{"src": "a", "margin": 2.0}, {"src": "b", "margin": 0.5}]
    unset = _examples(path=path)
    assert [e.prompt.info for e in unset] == [{"gap": 2, "src": "a"}, {"gap": 0.5, "src": "b"}]


def test_pairs_with_chat_messages_render_the_conversation(tmp_path, qwen2):
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": [TALK], "chosen": ["kind warm cat."],
                             "rejected": ["rude dull."]}), path)
    [example] = _examples(path=path)
    assert example.prompt.messages == TALK and example.responses == ("kind warm cat.",
                                                                     "rude dull.")
    [pair] = _imported(tmp_path, qwen2, path=str(path))
    assert pair.prompt_length > 0 and pair.task_id == "chat-0"
    assert pair.chosen_tokens[:pair.prompt_length].tolist() == \
        pair.rejected_tokens[:pair.prompt_length].tolist()


def test_webgpt_layout_chooses_the_higher_score_and_skips_ties(tmp_path, qwen2, caplog):
    path = datasets_folder(tmp_path / "comparisons", {"train": WEBGPT})
    with caplog.at_level(logging.INFO, logger="rft_hpc.tasks.offline_rows"):
        examples = _examples(path=path, layout="webgpt")
    assert [(e.prompt.prompt, e.responses) for e in examples] == [
        ("Why is the sky blue?", ("Scattering.", "Paint.")),
        ("Who wrote Hamlet?", ("Shakespeare.", "Marlowe."))]
    assert [e.prompt.task_id for e in examples] == ["comparisons-0", "comparisons-2"]
    assert [e.prompt.info for e in examples] == [{"tokens_0": [1, 2], "margin": 2.0},
                                                 {"tokens_0": [4], "margin": 1.0}]
    [message] = [r.getMessage() for r in caplog.records]
    assert "1 tied comparison(s) skipped" in message and "2 preference pair(s)" in message
    pairs = _imported(tmp_path, qwen2, path=str(path), layout="webgpt")
    assert len(pairs) == 2 and [p.info["margin"] for p in pairs] == [2.0, 1.0]


def test_webgpt_layout_with_mapped_keys_and_text_questions_in_jsonl(tmp_path):
    path = _jsonl(tmp_path / "cmp.jsonl", [
        {"q": "Describe the cat.", "a": "dull.", "b": "kind cat.", "sa": -1, "sb": 2}])
    keys = {"question": "q", "answer_0": "a", "answer_1": "b", "score_0": "sa",
            "score_1": "sb"}
    [example] = _examples(path=path, layout="webgpt", keys=keys)
    assert example.responses == ("kind cat.", "dull.")
    assert example.prompt.info == {"margin": 3.0} and example.prompt.task_id == "cmp-1"


def test_a_source_of_ties_only_says_so(tmp_path):
    path = _jsonl(tmp_path / "ties.jsonl", [
        {"question": "q", "answer_0": "a", "answer_1": "b", "score_0": 1, "score_1": 1}])
    with pytest.raises(UserError, match="holds no preference pairs: all 1 comparison"):
        _examples(path=path, layout="webgpt")


ROW = {"question": "Describe the cat.", "answer_0": "kind.", "answer_1": "rude.",
       "score_0": 1.0, "score_1": -1.0}
BAD_ROWS = {
    "missing key": ({k: v for k, v in ROW.items() if k != "score_1"},
                    "line 2: no column 'score_1'"),
    "score text": ({**ROW, "score_0": "high"},
                   "line 2: column 'score_0' holds a string, expected a finite number"),
    "score boolean": ({**ROW, "score_1": True},
                      "line 2: column 'score_1' holds a boolean, expected a finite number"),
    "score null": ({**ROW, "score_0": None},
                   "line 2: column 'score_0' holds null, expected a finite number"),
    "question mapping": ({**ROW, "question": {"id": "q7"}},
                         "line 2: column 'question' holds a mapping without a string "
                         "'full_text' (keys: id)"),
    "empty answer": ({**ROW, "answer_1": ""}, "line 2: column 'answer_1' is empty"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_webgpt_rows_name_file_row_and_key(tmp_path, case):
    bad, message = BAD_ROWS[case]
    path = _jsonl(tmp_path / "cmp.jsonl", [ROW, bad])
    with pytest.raises(UserError) as err:
        _examples(path=path, layout="webgpt")
    assert f"1 bad WebGPT comparison row(s):\n{path}, {message}" in str(err.value)


def test_a_column_the_source_lacks_and_a_bad_margin_are_named(tmp_path):
    path = tmp_path / "cmp.parquet"
    pq.write_table(pa.table({k: [v] for k, v in ROW.items() if k != "score_0"}), path)
    with pytest.raises(UserError, match=f"{path}: no column 'score_0' for the first answer's "
                                        "score; the columns there are: question, answer_0"):
        _examples(path=path, layout="webgpt")
    pairs = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b",
                                               "margin": "big"}])
    with pytest.raises(UserError, match=f"{pairs}, line 1: column 'margin' holds a string"):
        _examples(path=pairs, keys={"margin": "margin"})


def test_validate_names_the_config_key_of_a_bad_comparison_file(tmp_path):
    path = _jsonl(tmp_path / "cmp.jsonl", [{**ROW, "score_0": "x"}])
    with pytest.raises(UserError, match=r"^data: 1 bad WebGPT comparison row\(s\):\n.*"
                                        r"line 1: column 'score_0'"):
        check_task_sources(_config(tmp_path, tmp_path / "model", path=str(path),
                                   layout="webgpt"))


def test_layout_and_margin_settings_that_do_not_fit_are_config_errors():
    for data, message in [
            ({"source": "file", "path": "x.jsonl", "layout": "webgpt"},
             "layout webgpt holds preference pairs: it needs kind dpo"),
            ({"source": "tasks", "kind": "dpo", "layout": "webgpt"},
             "layout only apply with source file"),
            ({"source": "file", "path": "x.jsonl", "kind": "dpo", "layout": "webgpt",
              "keys": {"margin": "m"}}, "keys.margin applies to kind dpo in layout pairs"),
            ({"source": "file", "path": "x.jsonl", "keys": {"margin": "m"}},
             "keys.margin applies to kind dpo")]:
        with pytest.raises(ValueError, match=message):
            ExperimentConfig.model_validate({"data": data})
    frozen = ExperimentConfig.model_validate({"data": {
        "source": "file", "path": "x.jsonl", "kind": "dpo", "layout": "webgpt"}})
    assert ExperimentConfig.model_validate(frozen.model_dump(mode="json")).data == frozen.data
