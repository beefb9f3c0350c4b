"""Generated preference data with a hidden gold rule (`rft_hpc.tasks.preferences`): the rule
itself, its reward-function form, the WebGPT-layout rows and files a reward model learns
from, and the `describe` task source of the RL stage's prompts."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from rft_hpc.config import ExperimentConfig
from rft_hpc.config.offline_data import DataConfig
from rft_hpc.config.tasks import GOLD_REWARD, DescribeTasks
from rft_hpc.tasks.offline_rows import load_offline_examples
from rft_hpc.tasks.preferences import (
    EVAL_TOPICS,
    TOPICS,
    TRAIN_TOPICS,
    gold_reward,
    gold_score,
    preference_rows,
    prompt_topic,
    write_preference_file,
)
from rft_hpc.tasks.reward_check import reward_problems
from rft_hpc.tasks.rewards import call_reward
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task

CAT = "Describe the cat."


@pytest.mark.parametrize(("response", "score"), [
    ("kind clear bright.", 3.0),            # +1 per distinct good word
    ("kind kind kind kind.", 1.0),          # repeating a good word does not pay
    ("kind rude dull.", -1.0),              # -1 per distinct bad word
    ("rude rude.", -1.0),
    ("the cat is warm.", 2.0),              # +1 for the topic
    ("the cat cat cat.", 1.0),
    ("the dog is warm.", 1.0),              # another topic earns nothing
    ("the big old tree", 0.0),              # neutral words; the final "." is optional
    ("  kind   cat.\n", 2.0),               # surrounding and inner whitespace
    ("", 0.0), ("   .", 0.0),               # empty
    ("Kind cat.", 0.0), ("kind, cat.", 0.0), ("kind cat!", 0.0), ("kind café.", 0.0),
])
def test_gold_score_counts_distinct_words_and_the_topic(response, score):
    assert gold_score(CAT, response) == score


def test_a_prompt_without_a_topic_earns_no_topic_bonus():
    assert prompt_topic(CAT) == "cat" and prompt_topic("Describe a cat.") is None
    assert gold_score("What is a cat?", "warm cat.") == 1.0


def test_gold_reward_reads_the_topic_from_the_prompt_or_the_messages():
    assert gold_reward(Task("t", prompt=CAT), "warm cat.") == 2.0
    chat = Task("c", messages=[{"role": "system", "content": "Be kind."},
                               {"role": "user", "content": CAT}])
    assert gold_reward(chat, "warm cat.") == 2.0
    assert call_reward(Task("t", prompt=CAT, reward=GOLD_REWARD), "calm calm cat.") == 2.0


def test_preference_rows_are_repeatable_scored_by_the_rule_and_hold_ties():
    rows = preference_rows(200, seed=3)
    assert rows == preference_rows(200, seed=3) and rows != preference_rows(200, seed=4)
    for row in rows:
        assert row["answer_0"] != row["answer_1"]
        assert prompt_topic(row["question"]) in TOPICS
        assert row["score_0"] == gold_score(row["question"], row["answer_0"])
        assert row["score_1"] == gold_score(row["question"], row["answer_1"])
        assert row["answer_0"].endswith(".") and row["answer_0"].isascii()
        assert 3 <= len(row["answer_0"].split()) <= 8
    ties = sum(row["score_0"] == row["score_1"] for row in rows)
    assert 0 < ties < len(rows) // 2


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_preference_file_imports_in_the_webgpt_layout_without_its_ties(tmp_path, suffix):
    path = write_preference_file(tmp_path / f"prefs{suffix}", 50, seed=1)
    rows = preference_rows(50, seed=1)
    on_disk = (pq.read_table(path).to_pylist() if suffix == ".parquet"
               else [json.loads(line) for line in path.read_text().splitlines()])
    assert on_disk == rows
    data = DataConfig(source="file", kind="dpo", layout="webgpt", path=path)
    examples = load_offline_examples(data.file_source(), data.kind, layout=data.layout)
    decided = [r for r in rows if r["score_0"] != r["score_1"]]
    assert len(examples) == len(decided) < len(rows)
    for example, row in zip(examples, decided, strict=True):
        chosen, rejected = example.responses
        assert gold_score(row["question"], chosen) > gold_score(row["question"], rejected)
        assert example.prompt.info["margin"] == abs(row["score_0"] - row["score_1"])


def test_describe_tasks_hold_out_their_own_topics_repeatably():
    config = ExperimentConfig.model_validate(
        {"tasks": {"type": "describe", "train_size": 300, "eval_size": 10}})
    assert isinstance(config.tasks, DescribeTasks)
    assert list(reward_problems(config)) == []  # the default reward imports and binds
    train, held_out = build_tasks(config.tasks, seed=7)
    assert (train, held_out) == build_tasks(config.tasks, seed=7)
    assert train != build_tasks(config.tasks, seed=8)[0]
    assert len(train) == 300 and len(held_out) == 10
    assert {t.answer for t in train} == set(TRAIN_TOPICS)
    assert {t.answer for t in held_out} == set(EVAL_TOPICS)
    assert not {t.prompt for t in train} & {t.prompt for t in held_out}
    assert len({t.task_id for t in train + held_out}) == 310
    assert {t.reward for t in train + held_out} == {GOLD_REWARD}
    assert all(prompt_topic(t.prompt) == t.answer for t in train + held_out)
    mine = DescribeTasks(train_size=2, eval_size=1, reward="exact_match")
    mine_train, mine_held_out = build_tasks(mine, seed=0)
    assert {t.reward for t in mine_train + mine_held_out} == {"exact_match"}
