"""Bad task and offline data through the CLI: `validate`, `run` and `submit` each refuse it with one
message naming file, row and column, exit 2, no traceback, and create or submit nothing."""

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def rft(*args, cwd):
    """Run `rft-hpc ARGS` in a fresh interpreter; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def refused_with_one_message(result, tmp_path, section, fragments):
    """`result` is one message under `section` holding every fragment, exit 2, no
    traceback, and no run directory or model was created."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.count(section) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "model").exists()


def _config(tmp_path, name, columns, body):
    """A config over the Parquet file `name` holding `columns`; `body` is its sections
    after run and model (YAML)."""
    pq.write_table(pa.table(columns), tmp_path / name)
    config = tmp_path / "exp.yaml"
    config.write_text(f"run: {{name: bad, root: {tmp_path / 'runs'}}}\n"
                      f"model: {{path: {tmp_path / 'model'}, init: tiny}}\n" + body)
    return config


CASES = {
    "missing column": (
        {"question": ["1+1?", "2+2?"], "answer": ["#### 2", "#### 4"]}, "{prompt: problem}",
        ["gsm8k.parquet: no column 'problem'", "the columns there are: question, answer"]),
    "wrong type": (
        {"question": ["1+1?", "2+2?"], "answer": ["#### 2", None]}, "{prompt: question}",
        ["gsm8k.parquet, row 1: column 'answer' holds null, expected a string"]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", [["validate"], ["run"], ["submit"]])
def test_bad_task_data_is_one_message_exit_2_and_nothing_starts(tmp_path, case, command):
    columns, keys, fragments = CASES[case]
    config = _config(tmp_path, "gsm8k.parquet", columns,
                     f"tasks: {{type: file, path: gsm8k.parquet, keys: {keys}}}\n")
    refused_with_one_message(rft(*command, config, cwd=tmp_path), tmp_path, "tasks:", fragments)


OFFLINE_CASES = {
    "missing column": (
        {"q": ["1+1=", "2+2="], "answer": ["2", "4"]}, "keys: {prompt: q, response: a}",
        ["expert.parquet: no column 'a' for the response", "the columns there are: q, answer"]),
    "wrong type": (
        {"prompt": ["1+1=", "2+2="], "chosen": ["2", "4"], "rejected": [3, 5]}, "kind: dpo",
        ["2 bad DPO row(s)",
         "expert.parquet, row 1: column 'rejected' holds an integer, expected a string"]),
    "empty response": (
        {"q": ["1+1=", "2+2=", "3+3="], "a": ["2", "", "6"]}, "keys: {prompt: q, response: a}",
        ["expert.parquet, row 1: column 'a' is empty"]),
    "WebGPT score": (
        {"question": ["Why?", "How?"], "answer_0": ["a", "b"], "answer_1": ["c", "d"],
         "score_0": [1.0, None], "score_1": [0.0, 0.0]}, "kind: dpo, layout: webgpt",
        ["1 bad WebGPT comparison row(s)",
         "expert.parquet, row 1: column 'score_0' holds null, expected a finite number"]),
    "chat under raw prompts": (
        {"messages": [[{"role": "user", "content": "1+1="},
                       {"role": "assistant", "content": "2"}]]}, "kind: sft",
        ["expert.parquet holds chat messages", "set prompt.format: chat"]),
}


@pytest.mark.parametrize("case", OFFLINE_CASES)
@pytest.mark.parametrize("command", [["validate"], ["run"], ["submit"]])
def test_bad_offline_data_is_one_message_exit_2_and_nothing_starts(tmp_path, case, command):
    columns, data, fragments = OFFLINE_CASES[case]
    config = _config(tmp_path, "expert.parquet", columns,
                     "mode: train\nalgorithm: {algorithm_type: sft}\n"
                     f"data: {{source: file, path: expert.parquet, {data}}}\n")
    refused_with_one_message(rft(*command, config, cwd=tmp_path), tmp_path, "data:", fragments)
