"""Offline SFT and DPO data from the user's files (`data: {source: file}`): JSONL, Parquet and
`datasets` folders through a key mapping, splits, row ranges and chat conversations, made
into buffer records with the explorers' prompt ids; bad rows named by file, row and column."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.chat_models import chat_model
from helpers.data_files import datasets_folder
from transformers import AutoTokenizer

from rft_hpc.buffer.offline import example_records
from rft_hpc.buffer.records import DPOPair, SFTSample
from rft_hpc.config import ExperimentConfig
from rft_hpc.config.offline_data import DataConfig
from rft_hpc.config.prompt import PromptConfig
from rft_hpc.core.errors import UserError
from rft_hpc.tasks.offline_rows import load_offline_examples
from rft_hpc.tasks.prompts import model_stop_ids, prompt_ids
from rft_hpc.tasks.task import Task

CHAT = PromptConfig(format="chat")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """The tiny Qwen2 chat model folder and its tokenizer."""
    folder = chat_model(tmp_path_factory.mktemp("qwen2") / "model", "qwen2")
    return folder, AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _data(**fields) -> DataConfig:
    return DataConfig(source="file", **fields)


def _examples(data: DataConfig):
    return load_offline_examples(data.file_source(), data.kind)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_parquet_with_mapped_columns_takes_a_row_range_and_keeps_other_columns(tmp_path):
    path = tmp_path / "expert.parquet"
    pq.write_table(pa.table({"q": [f"{i}+{i}=" for i in range(5)],
                             "a": [str(2 * i) for i in range(5)],
                             "src": ["book"] * 5}), path)
    examples = _examples(_data(path=path, rows=[1, 4], keys={"prompt": "q", "response": "a"}))
    assert [(e.prompt.prompt, e.responses) for e in examples] == [
        ("1+1=", ("2",)), ("2+2=", ("4",)), ("3+3=", ("6",))]
    assert [e.prompt.task_id for e in examples] == ["expert-1", "expert-2", "expert-3"]
    assert {e.prompt.taskset for e in examples} == {"expert"}
    assert [e.prompt.info for e in examples] == [{"src": "book"}] * 3


def test_dpo_jsonl_with_ids_and_tasksets_of_its_own(tmp_path):
    path = _jsonl(tmp_path / "prefs.jsonl", [
        {"id": "a", "question": "Capital of France?", "good": "Paris", "bad": "Lyon",
         "taskset": "geo"},
        {"id": 7, "question": "2+2?", "good": "4", "bad": "5"}])
    examples = _examples(_data(path=path, kind="dpo", keys={
        "prompt": "question", "chosen": "good", "rejected": "bad", "task_id": "id"}))
    assert [(e.kind, e.prompt.task_id, e.prompt.taskset, e.responses) for e in examples] == [
        ("dpo", "a", "geo", ("Paris", "Lyon")), ("dpo", "7", "prefs", ("4", "5"))]
    assert all(e.prompt.info == {} for e in examples)


def test_a_datasets_folder_split_of_conversations(tmp_path):
    talk = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4"}],
            [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]]
    path = datasets_folder(tmp_path / "chats", {"train": {"conv": talk},
                                                 "test": {"conv": talk[:1]}})
    examples = _examples(_data(path=path, split="train", keys={"messages": "conv"}))
    assert [e.responses for e in examples] == [("4",), ("Bye!",)]
    assert examples[0].prompt.messages == talk[0][:-1]
    assert examples[1].prompt.messages == talk[1][:1]
    assert [e.prompt.task_id for e in examples] == ["chats-train-0", "chats-train-1"]
    with pytest.raises(UserError, match="holds the splits train, test: choose one"):
        _examples(_data(path=path, keys={"messages": "conv"}))


def test_sft_records_hold_the_explorers_prompt_ids_and_end_with_the_end_of_turn(tmp_path,
                                                                               qwen2):
    folder, tok = qwen2
    talk = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    plain_file = _jsonl(tmp_path / "sft.jsonl", [{"note": "skipped by rows"},
                                                 {"prompt": "1+1?", "response": "2"}])
    chat_file = _jsonl(tmp_path / "chat.jsonl", [{"messages": talk}])
    stops = model_stop_ids(folder, tok, CHAT)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stops[0] == end
    plain, chat = example_records(
        _examples(_data(path=plain_file, rows=[1, 2])) + _examples(_data(path=chat_file)), tok,
        prompt_format=CHAT, stop_ids=stops)
    assert isinstance(plain, SFTSample) and isinstance(chat, SFTSample)
    prompt = prompt_ids(tok, Task("x", prompt="1+1?"), CHAT)
    assert plain.prompt_length == len(prompt)
    assert plain.tokens.tolist() == prompt + tok("2", add_special_tokens=False)["input_ids"] + [end]
    assert plain.response_mask.tolist() == [0] * len(prompt) + [1, 1]
    rendered = tok.apply_chat_template(talk[:1], tokenize=False, add_generation_prompt=True)
    chat_prompt = tok(rendered, add_special_tokens=False)["input_ids"]
    assert chat.tokens.tolist()[:chat.prompt_length] == chat_prompt
    assert tok.decode(chat.tokens[chat.prompt_length:]) == "4<|im_end|>"
    assert (plain.task_id, chat.task_id) == ("sft-2", "chat-1")  # JSONL: the line numbers


def test_dpo_records_share_the_prompt_and_end_each_response_with_the_stop_token(tmp_path,
                                                                               qwen2):
    _, tok = qwen2
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"instruction": ["2+2?"], "win": ["4"], "lose": ["five"],
                             "score": [0.9]}), path)
    [pair] = example_records(_examples(_data(path=path, kind="dpo", keys={
        "prompt": "instruction", "chosen": "win", "rejected": "lose"})), tok,
        prompt_format=CHAT)
    assert isinstance(pair, DPOPair) and pair.info == {"score": 0.9}
    p = pair.prompt_length
    assert pair.chosen_tokens[:p].tolist() == pair.rejected_tokens[:p].tolist()
    assert tok.decode(pair.chosen_tokens[p:]) == "4<|im_end|>"
    assert tok.decode(pair.rejected_tokens[p:]) == "five<|im_end|>"


BAD = {
    "missing column": ({"prompt": ["a", "b"], "answer": ["1", "2"]}, "sft", {},
                       "pairs.parquet: no column 'response' for the response; the columns "
                       "there are: prompt, answer"),
    "wrong type": ({"prompt": ["a", "b"], "response": ["1", None]}, "sft", {},
                   "1 bad SFT row(s):\n{path}, row 1: column 'response' holds null, expected "
                   "a string"),
    "empty response": ({"p": ["a", "b"], "c": ["x", "y"], "r": ["z", " "]}, "dpo",
                       {"prompt": "p", "chosen": "c", "rejected": "r"},
                       "{path}, row 1: column 'r' is empty"),
    "same pair": ({"prompt": ["a"], "chosen": ["x"], "rejected": ["x"]}, "dpo", {},
                  "{path}, row 0: columns 'chosen' and 'rejected' hold the same response"),
    "no assistant turn": ({"messages": [[{"role": "user", "content": "hi"}]]}, "sft", {},
                          "{path}, row 0: column 'messages', message 0: the conversation ends "
                          "with a 'user' message"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_rows_name_file_row_and_column(tmp_path, case):
    columns, kind, keys, message = BAD[case]
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(UserError) as err:
        _examples(_data(path=path, kind=kind, keys=keys))
    assert message.format(path=path) in str(err.value)


def test_data_settings_that_do_not_fit_the_source_are_config_errors():
    for data, message in [({"source": "file"}, "source file needs path"),
                          ({"source": "tasks", "rows": [0, 5]}, "rows only apply with source"),
                          ({"source": "jsonl", "path": "x.jsonl", "keys": {"prompt": "q"}},
                           "keys only apply with source file"),
                          ({"source": "file", "path": "x.parquet", "kind": "rl"},
                           "kind rl needs source jsonl")]:
        with pytest.raises(ValueError, match=message):
            ExperimentConfig.model_validate({"data": data})
    frozen = ExperimentConfig.model_validate({"data": {"source": "tasks", "kind": "dpo"}})
    again = ExperimentConfig.model_validate(frozen.model_dump(mode="json"))
    assert again.data == frozen.data
