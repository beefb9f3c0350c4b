"""An LLM judge as a reward, through the CLI as a user's: `rft-hpc run` on a config whose
reward is a weighted sum of a function and a tiny chat judge (trained here to answer
`Score: <the response's last character>`, tests/helpers/judges.py) explores, trains and
finishes. Each record's reward is recomputed here, the judge's answer by a plain greedy
transformers `generate` of the rubric in its chat template, read by a regular expression:
parseable answers give the weighted sum, unparseable ones fail their rollout (reward 0,
`info["reward_failure"]`), as many as the step metrics count (`judge_unparseable`), and the
explorer's log names each one's task id. The trainer's held-out evaluation scores its greedy
answers by the same sum, counting the unparseable ones in `eval_reward_errors`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from helpers.judges import tiny_judge
from helpers.reward_runs import reward_run_config
from helpers.runs import rollouts
from transformers import AutoModelForCausalLM, AutoTokenizer

from rft_hpc.config import load_config
from rft_hpc.core.rundir import read_jsonl
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.tasks.source import build_tasks


def experiment(tmp_path, tiny_model, judge):
    return reward_run_config(tmp_path, "judge", tiny_model, [
        "{name: exact_match, weight: 0.5}",
        f"{{judge: {judge}, template: 'Rate: {{response}}', parser: number, "
        "parser_args: {range: [0, 5]}, weight: 2.0, batch_size: 3}"])


def judge_scores(folder, responses):
    """The judge's parsed answer to each response (None: no number in it), each answered
    alone by a plain greedy generate, the first number clamped into [0, 5]."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    out = []
    for response in responses:
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"Rate: {response}"}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            row = model.generate(**ids, max_new_tokens=16, do_sample=False)[0]
        answer = tokenizer.decode(row[ids["input_ids"].shape[1]:], skip_special_tokens=True)
        found = re.search(r"[-+]?(\d+(\.\d*)?|\.\d+)", answer)
        out.append((answer, None if found is None else min(max(float(found[0]), 0.0), 5.0)))
    return out


@pytest.mark.timeout(600)
def test_a_run_scored_by_a_judge_counts_and_logs_its_unparseable_answers(tmp_path,
                                                                         tiny_model):
    judge = tiny_judge(tmp_path / "judge")
    config = experiment(tmp_path, tiny_model, judge)
    result = subprocess.run([sys.executable, "-m", "rft_hpc.cli", "run", str(config)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout + result.stderr
    stage = tmp_path / "runs" / "judge" / "stages" / "0-main"
    steps = read_metrics(stage / "metrics" / "explorer-0.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    records = rollouts(stage)
    assert len(records) == 16
    train, held_out = build_tasks(load_config(config).tasks, 0)
    tasks = {t.task_id: t for t in (*train, *held_out)}
    judged = judge_scores(judge, [r.info["response"] for r in records])
    unparseable = [r for r, (_, score) in zip(records, judged, strict=True) if score is None]
    assert 0 < len(unparseable) < len(records), judged  # both kinds of answers
    for record, (answer, score) in zip(records, judged, strict=True):
        if score is None:
            assert record.reward == 0.0
            assert record.info["reward_failure"] == \
                f"judge:{judge}: unparseable answer {answer!r}"
        else:
            exact = float(record.info["response"].strip() == tasks[record.task_id].answer)
            assert record.reward == pytest.approx(0.5 * exact + 2.0 * score, abs=1e-6)
            assert "reward_failure" not in record.info
    assert sum(s["judge_unparseable"] for s in steps) == len(unparseable)
    assert sum(s["reward_errors"] for s in steps) == len(unparseable)
    log = (stage / "jobs" / "explorer-0.log").read_text()
    warnings = [line for line in log.splitlines() if "unparseable answer" in line]
    assert len(warnings) == len(unparseable)
    for record in unparseable:
        assert any(f"on task {record.task_id} (rollout" in w for w in warnings), warnings

    evals = [m for m in read_metrics(stage / "metrics" / "trainer.jsonl")
             if m.get("eval_reward") is not None]
    answers = read_jsonl(sorted((stage / "eval" / "answers").glob("*.jsonl"))[-1])
    assert [a["task_id"] for a in answers] == [t.task_id for t in held_out]
    greedy = judge_scores(judge, [a["answer"] for a in answers])
    expected = [0.0 if score is None else
                0.5 * float(a["answer"].strip() == tasks[a["task_id"]].answer) + 2.0 * score
                for a, (_, score) in zip(answers, greedy, strict=True)]
    assert [a["reward"] for a in answers] == pytest.approx(expected, abs=1e-6)
    assert evals[-1]["eval_reward_errors"] == sum(score is None for _, score in greedy)
