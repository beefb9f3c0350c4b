"""The reward job in local mode, through the CLI as a user's: `rft-hpc run` with
`reward_job.count: 1` starts the reward job as a process of its own beside two explorers;
the run finishes, every record's reward is the function term plus the reward-model term a
plain transformers forward gives for the same text plus the LLM judge's parsed answer a
plain greedy generate gives (what the explorer itself would score; an unparseable answer
fails its record, as in the explorer), every record names the request the reward job scored
it in (its ledger says so), and the audit passes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.judges import tiny_judge
from helpers.paths import DEMO
from helpers.reward_models import reward_model
from helpers.reward_runs import reward_run_config
from helpers.runs import rollouts
from test_judge_run import judge_scores
from test_reward_model_run import model_scores

from rft_hpc.config import load_config
from rft_hpc.tasks.rewards import exact_match
from rft_hpc.tasks.source import build_tasks


def rft(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(600)
def test_a_local_reward_job_scores_every_explorer_once_as_the_explorer_would(
        tmp_path, tiny_model):
    rm, judge = reward_model(tmp_path / "rm"), tiny_judge(tmp_path / "judge")
    config = reward_run_config(tmp_path, "rj", tiny_model, [
        "{name: exact_match, weight: 0.5}", f"{{model: {rm}, weight: 2.0, batch_size: 6}}",
        f"{{judge: {judge}, template: 'Rate: {{response}}', parser_args: {{range: [0, 5]}}}}"],
        explorer="count: 2, tasks_per_step: 1", extra="reward_job: {count: 1}\n")
    result = rft("run", config, cwd=tmp_path, timeout=540)
    assert result.returncode == 0, result.stdout + result.stderr
    stage = tmp_path / "runs" / "rj" / "stages" / "0-main"
    records = rollouts(stage)
    assert len(records) == 16  # 2 trainer steps x 8, each record once
    train, _ = build_tasks(load_config(config).tasks, 0)
    tasks = {t.task_id: t for t in train}
    pairs = [(tasks[r.task_id].prompt, r.info["response"]) for r in records]
    judged = judge_scores(judge, [r.info["response"] for r in records])
    expected = [0.0 if verdict is None else
                0.5 * exact_match(tasks[r.task_id], r.info["response"]) + 2.0 * score + verdict
                for r, score, (_, verdict) in zip(records, model_scores(rm, pairs), judged,
                                                  strict=True)]
    assert [r.reward for r in records] == pytest.approx(expected, abs=1e-5)
    failed = [f"judge:{judge}: unparseable answer {answer!r}" for answer, v in judged
              if v is None]
    assert [r.info["reward_failure"] for r in records if "reward_failure" in r.info] == failed
    assert 0 < len(failed) < len(records)  # the judge's answers: both kinds came through

    # every record names its request and place there, each once; the ledger scored them
    named = [r.info["reward_request"] for r in records]
    assert len(set(named)) == len(records)
    assert {n.split(".")[0] for n in named} == {"explorer-0", "explorer-1"}
    events = [json.loads(line) for line in
              (stage / "ledger" / "reward-0.jsonl").read_text().splitlines()]
    scored = {e["request"] for e in events if e["event"] == "scored"}
    assert {n.rsplit("/", 1)[0] for n in named} <= scored
    assert [e["event"] for e in events][:2] == ["ledger", "start"]
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "done"
    assert json.loads((stage / "state" / "reward-0.json").read_text())["status"] == "done"
    assert list((stage / "reward" / "job-0").iterdir()) == []  # nothing left behind

    audit = rft("audit", tmp_path / "runs" / "rj", "--json", cwd=tmp_path)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    report = json.loads(audit.stdout)
    assert report["ok"]
    checks = {c["check"]: c["result"] for c in report["stages"][0]["checks"]}
    assert checks["reward ledgers"] == checks["reward requests"] == "PASS"
    assert report["stages"][0]["reward_jobs"]["records"] == 16


def test_the_reward_job_array_is_rendered_with_its_own_slurm_settings(tmp_path, tiny_model):
    out = tmp_path / "scripts"
    result = rft("render", DEMO, "--set", f"run.root={tmp_path}", "--set",
                 f"model.path={tiny_model}", "--set", "reward_job.count=2", "--set",
                 "reward_job.slurm={partition: gpu, gpus_per_node: 1, time: '02:00:00'}",
                 "--name", "rj", "--out", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    script = (out / "grpo.reward.sbatch").read_text()
    for line in ("#SBATCH --array=0-1", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=1",
                 "#SBATCH --time=02:00:00", "#SBATCH --requeue", "#SBATCH --signal=USR2@"):
        assert line in script, script
    assert f'role reward {tmp_path}/rj/stages/1-grpo --index "$SLURM_ARRAY_TASK_ID"' in script
    assert "--name=rj.grpo.explorer" in script  # requeued only while its explorers are queued
    assert "--gpus-per-node" not in (out / "grpo.explorer.sbatch").read_text()
    submit = (out / "submit.sh").read_text()
    assert "grpo.reward.sbatch" in submit and "sft.reward.sbatch" not in submit
