"""The tool recipe, end to end (configs/recipes/tools-cpu.yaml, docs/agents.md): a locally
built tiny two-layer Mistral-family chat model, accounts whose codes it cannot know alone
(its best guess is right one time in three) and the `lookup` tool that knows them. Stage
`sft` warms it up on demonstrations of which 22 % call the tool (the rest answer at once);
stage `grpo` plays the multi-turn workflow with the tool. Held-out success is each of 500
held-out accounts played greedily with the tool (eval/tool_trajectories.py): right when the
trajectory's reward is 1, its final answer the account's code.

GRPO must raise the held-out success over the warm-up's by more than noise can: the same
500 accounts are played by the warm-up's final weights and by GRPO's, and the discordant
pairs are put to McNemar's exact test (helpers/stats.py, as test_real_workload.py does):
one-sided p below 0.001. The explorer's per-step tool metrics (`tools/success_rate`,
`tools/malformed_rate`) must be in every step's metrics and in report.png.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from helpers.export_checks import final_eval
from helpers.learning import SEED, pinned, record
from helpers.paths import ROOT
from helpers.runs import rft
from helpers.stats import mcnemar_p

from rft_hpc.config import load_config
from rft_hpc.core.rundir import RunDir, read_jsonl
from rft_hpc.tasks.rewards import exact_match
from rft_hpc.tasks.source import build_tasks

RECIPE = ROOT / "configs" / "recipes" / "tools-cpu.yaml"
HELD_OUT = 500
P_MAX = 1e-3
OVERRIDES = ("stages.0.eval.interval=0", "eval.interval=0", *pinned(trainer_stages=1))
"""The recipe's regime, evaluated at the start and end of each stage, seed and threads
pinned."""


def _steps(stage: int | None) -> int:
    config = load_config(RECIPE)
    return (config.stage_configs()[stage][1] if stage is not None else config).trainer.steps


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory) -> Path:
    """A finished two-stage run (SFT warm-up on demonstrations, GRPO with the tool) of the
    recipe, its model built at the learning seed: at seed 0 by the run itself, as a user's
    run builds it (`model.init`: its vocabulary learned from the recipe's prompts)."""
    from rft_hpc.run.model_init import init_model

    tmp = tmp_path_factory.mktemp("tool-recipe")
    model = tmp / "model"
    if SEED != 0:  # the kind's own weights are seed 0's
        init_model(load_config(RECIPE, OVERRIDES), model, seed=SEED)
    sets = [f"run.root={tmp}", f"model.path={model}", *OVERRIDES]
    result = rft("run", RECIPE, *[a for s in sets for a in ("--set", s)], timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "tools-cpu"


def _successes(stage: Path, version: int) -> list[bool]:
    """Whether each held-out problem's greedy trajectory under weights `version` of `stage`
    (eval/answers/, recorded by the trainer's evaluation) succeeded; its final answer is
    scored again here, and their share is the run's own `eval_accuracy`."""
    config = load_config(stage / "config.yaml")
    _, tasks = build_tasks(config.tasks, config.run.seed)
    answers = read_jsonl(RunDir(stage).heldout_answers(version))
    assert len(tasks) == HELD_OUT and [a["task_id"] for a in answers] == [t.task_id
                                                                           for t in tasks]
    success = [a["reward"] >= 1.0 for a in answers]
    assert success == [exact_match(t, a["answer"]) >= 1.0
                       for t, a in zip(tasks, answers, strict=True)]
    assert sum(success) / len(success) == final_eval(stage)["eval_accuracy"]
    return success


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_grpo_raises_held_out_tool_success_beyond_noise(tool_run):
    before = _successes(tool_run / "stages" / "0-sft", _steps(0))
    after = _successes(tool_run / "stages" / "1-grpo", _steps(None))
    p, b, c = mcnemar_p(before, after)
    print(f"held-out tool success {sum(before) / HELD_OUT:.3f} -> {sum(after) / HELD_OUT:.3f}:"
          f" {b} problems right after GRPO only, {c} before only, one-sided p = {p:.2g}")
    record("tool recipe", before=sum(before) / HELD_OUT, after=sum(after) / HELD_OUT,
           b=b, c=c, p=p)
    assert sum(after) > sum(before) and p < P_MAX, (b, c, p)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_tool_metrics_are_in_every_step_and_the_report(tool_run):
    stage = tool_run / "stages" / "1-grpo"
    steps = [m for m in read_jsonl(stage / "metrics" / "explorer-0.jsonl") if "step" in m]
    assert len(steps) >= _steps(None)
    for m in steps:
        assert 0.0 <= m["tools/success_rate"] <= 1.0 and 0.0 <= m["tools/malformed_rate"] <= 1.0
        assert m["tools/tool_calls"] >= 1
    summary = json.loads((tool_run / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == ["sft", "grpo"]
    png = (tool_run / "report.png").read_bytes()
    # four panels: reward, held-out success, off-policy, and the tool calls' rates
    assert struct.unpack(">I", png[16:20])[0] == 2100
