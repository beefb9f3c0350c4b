"""The demo and each RL algorithm's example config really learn: the README's demo raises
held-out accuracy by far more than noise can (at least 15 points), and each algorithm, run
for 40 steps from the demo's SFT-warmed model, raises held-out greedy accuracy on the demo's
500 held-out two-digit additions beyond noise: McNemar's one-sided exact p (the same problems
before and after, helpers/stats.py) below 0.001, as the real workload's test asks. GRPO with
its explorers up to 4 versions ahead and an off-policy correction learns as much as the
demo's one version ahead without one, and GRPO training a rank-8 LoRA adapter beats the
starting model by more than noise can.

Until 2026-12-06 each algorithm had to gain 10 points on the first 200 problems: measured
+19 to +31 after 30 steps at two seeds (docs/algorithms.md), but at learning seed 2 (one
thread) the warm-up ends at 41 % and the gains were +10.5 (reinforce++) to +18 (mix): the
bound sat on the effect, not above the noise (a paired gain on 200 problems has a noise of
~3.5 points). Figures for every seed and thread count: the learning table (issue 31). The
warm-up (the SFT stage of this module's demo run, ~50 % accuracy) is saved once as a model
folder, so every run starts from the same weights and is measured on the same problems.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers.learning import SEED, pinned, record
from helpers.paths import DEMO, ROOT
from helpers.stats import mcnemar_p

from rft_hpc.core.rundir import RunDir, read_jsonl

STEPS = 40
"""Steps of each run: at 30, OPMD at learning seed 0 with two threads gained 8.6 points,
p = 1.8e-4, too near the bound (the learning table, 2026-12-06)."""
PAPER_STEPS = 20
"""Steps of the papers' presets (GSPO ... ReMax): at 40 (learning seed 0, one thread,
2026-12-07) each gained 19-27 points, p 6.8e-19 to 4.0e-25; at 20, see docs/algorithms.md."""
EVAL_SIZE = 500
"""Held-out problems each run is scored on: all of the demo's (its warm-up trained on none)."""
P_MAX = 1e-3
"""One-sided McNemar p (helpers/stats.py) below which a run's gain is beyond noise."""
OFFSET_EVAL_SIZE = 200
"""The off-policy comparison's problems: the first 200, on which its bound was set."""
DISTILL_STEPS = 20
"""Steps of on-policy distillation from the warm-up (docs/algorithms.md for the figures)."""

# algorithm -> (example config, overrides its RL stage holds, a metric only it logs)
ALGORITHMS = {
    "grpo": ("grpo.yaml", (), "pg_loss"),
    "ppo": ("ppo.yaml", (), "value_loss"),
    "rloo": ("rloo.yaml", (), "pg_loss"),
    "reinforceplusplus": ("reinforceplusplus.yaml", (), "kl_penalty"),
    "opmd": ("opmd.yaml", (), "opmd_loss"),
    # mix.yaml's RL stage brings the expert samples and the mixture sampler; without the
    # stages they are top-level settings
    "mix": ("mix.yaml", ("data={source: tasks, kind: sft, taskset: expert}",
                         "buffer.sampler={type: mixture, weights: {arith2: 4, expert: 1}}"),
            "expert/sft_loss"),
    # GRPO's advantages with each paper's loss, and ReMax (docs/algorithms.md): grpo.yaml's
    # stage with the preset, PAPER_STEPS steps
    **{kind: ("grpo.yaml", (f"algorithm={{algorithm_type: {kind}}}",
                            f"trainer.steps={PAPER_STEPS}", f"eval.interval={PAPER_STEPS}"),
              metric)
       for kind, metric in (("gspo", "seq_ratio_mean"), ("dr_grpo", "clip_fraction"),
                            ("cispo", "clip_fraction"), ("sapo", "gate_mean"),
                            ("clip_cov", "cov_clip_fraction"), ("kl_cov", "kl_cov_fraction"),
                            ("remax", "pg_loss"))},
}


def rft(*args: object) -> subprocess.CompletedProcess[str]:
    """`rft-hpc` as a subprocess in the repository root."""
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)


def sets(*pairs: str) -> list[str]:
    """`--set` options for the `key=value` pairs."""
    return [arg for pair in pairs for arg in ("--set", pair)]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's demo as it is (its own tiny model, SFT warm-up, then GRPO), run once in a
    temporary folder: the demo test reads its summary, the RL runs start from its warm-up."""
    from rft_hpc.models.tiny import INIT_KINDS, init_tiny_model

    root = tmp_path_factory.mktemp("demo")
    # the demo's own tiny model (`model.init: tiny`), from the learning seed
    init_tiny_model(root / "models" / "tiny", replace(INIT_KINDS["tiny"], seed=SEED))
    result = rft("run", DEMO, *sets(f"run.root={root}", f"model.path={root}/models/tiny",
                                    *pinned(trainer_stages=1)))
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def _demo_correct(demo_run: Path, version: int) -> list[bool]:
    """Whether the demo's GRPO stage answered each held-out problem right under weights
    `version` (its trainer's evaluation, eval/answers/), in the stage's task order."""
    stage = RunDir(demo_run / "demo" / "stages" / "1-grpo")
    return [a["reward"] >= 1.0 for a in read_jsonl(stage.heldout_answers(version))]


@pytest.mark.timeout(1200)  # the whole README demo: 70-230 s here
def test_the_demo_raises_held_out_accuracy_beyond_noise(demo_run: Path) -> None:
    """The README's demo: GRPO must really learn, by far more than noise can. The same 500
    held-out problems are answered greedily at the start of the GRPO stage (the SFT warm-up's
    weights) and at its end; McNemar's one-sided exact p (helpers/stats.py, as the real
    workload's test) must be below 0.001, and the gain at least 15 points.

    The bound was +25 points until 2026-12-06: the size of the effect itself, not of the
    noise. Measured at one thread: seed 0 53.4 % -> 80.2 % (+26.8), seed 1 45.2 % -> 72.6 %
    (+27.4), seed 2 44.8 % -> 69.2 % (+24.4, FAILED the old bound; before per-group seeds).
    At seed 2 the demo's GRPO levels off near 70 % whatever was tried (GRPO stage alone,
    same warm-up): lr 2e-5 +25.2, temperature 0.7 +25.8, 8 tasks a step +25.2, 250 steps
    +25.2, dynamic sampling +25.2, 16 rollouts a task +27.8, a 250-step warm-up +8.8. The
    paired noise of a gain on 500 problems is ~2.5 points (sqrt(b + c) / 500 with b + c ~
    150), so 15 points is four of them below the weakest gain measured, and a +24 gain has
    p ~ 1e-25. Figures for every seed and thread count: the learning table (issue 31)."""
    summary = json.loads((demo_run / "demo" / "summary.json").read_text())
    ev = summary["eval"]
    print(json.dumps(summary["eval"]), json.dumps(summary["seconds"]))
    grpo = summary["stages"][-1]
    before, after = _demo_correct(demo_run, 0), _demo_correct(demo_run, grpo["trainer_steps"])
    assert len(before) == len(after) == 500
    assert sum(before) / 500 == ev["initial_accuracy"] and sum(after) / 500 == ev["final_accuracy"]
    p, b, c = mcnemar_p(before, after)
    print(f"demo: {b} problems right after GRPO only, {c} before only, one-sided p = {p:.2g}")
    record("demo", before=ev["initial_accuracy"], after=ev["final_accuracy"], b=b, c=c, p=p)
    assert p < 1e-3 and ev["final_accuracy"] - ev["initial_accuracy"] >= 0.15, (ev, b, c, p)


@pytest.fixture(scope="module")
def warm_model(demo_run: Path) -> Path:
    """The tiny model after the demo's SFT stage (configs/sft.yaml as a stage: 350 SFT
    steps), saved as a Hugging Face model folder (`model.start_weights` is the stage chain's,
    so a run of its own needs a real folder).

    The warm-up keeps the demo's 500 held-out problems: the runs' 200 are the first of them
    (one seeded shuffle), so none was trained on. (With 200 held out, the SFT data and order
    change, and so does the warm-up's accuracy: ~50 % here, ~70 % there.)"""
    summary = json.loads((demo_run / "demo" / "summary.json").read_text())
    sft = summary["stages"][0]
    assert sft["name"] == "sft" and sft["trainer_steps"] == 350, sft
    accuracy = sft["eval_final"]
    print(f"SFT warm-up: held-out accuracy {accuracy:.3f}")
    # warmed enough to be rewarded often, and far enough from 100 % to show a gain
    assert 0.2 <= accuracy <= 0.75, accuracy
    return model_folder(demo_run / "models" / "tiny", demo_run / "demo" / "stages" / "0-sft",
                        350, demo_run / "warm-model")


def model_folder(base: Path, stage: Path, version: int, out: Path) -> Path:
    """`out`: the model folder `base` (and its tokenizer) with the weights `version` that
    the run's `stage` published."""
    from transformers import AutoModelForCausalLM

    from rft_hpc.sync.weight_files import load_weights

    model = AutoModelForCausalLM.from_pretrained(base)
    model.load_state_dict(load_weights(stage / "weights", version))
    model.save_pretrained(out, safe_serialization=True)
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def teacher_model(demo_run: Path, warm_model: Path) -> Path:
    """The demo's final weights (its GRPO stage's last version) as a model folder with the
    warm-up's tokenizer: on-policy distillation's teacher."""
    steps = json.loads((demo_run / "demo" / "summary.json").read_text())["stages"][-1][
        "trainer_steps"]
    return model_folder(warm_model, demo_run / "demo" / "stages" / "1-grpo", steps,
                        demo_run / "teacher-model")


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory: pytest.TempPathFactory, warm_model: Path,
           ) -> Callable[..., Path]:
    """`rl_run(name, config, *overrides)`: the RL stage of `configs/<config>` run once for
    STEPS steps from the warm-up (held-out scores at step 0 and STEPS), its run folder; the
    same name again gives the same run (the off-policy comparison reuses the grpo case)."""
    runs: dict[str, Path] = {}

    def run(name: str, config: str, *overrides: str) -> Path:
        if name not in runs:
            root = tmp_path_factory.mktemp(name)
            result = rft("run", ROOT / "configs" / config,
                         *sets(f"run.root={root}", "run.name=rl", f"model.path={warm_model}",
                               "stages=[]", f"tasks.eval_size={EVAL_SIZE}",
                               f"trainer.steps={STEPS}", f"eval.interval={STEPS}", *pinned(),
                               *overrides))
            assert result.returncode == 0, result.stderr[-3000:]
            runs[name] = root / "rl"
        return runs[name]

    return run


def trainer_metrics(run: Path) -> list[dict]:
    """The trained steps' metrics of a one-stage run."""
    rows = read_jsonl(run / "stages" / "0-main" / "metrics" / "trainer.jsonl")
    return [m for m in rows if "loss" in m]


def final_answers(run: Path, step: int = STEPS, first: int = EVAL_SIZE) -> list[bool]:
    """Whether each of the `first` held-out tasks was answered right by the run's weights of
    `step` (its final ones), in eval-split order (the trainer's recorded greedy answers)."""
    rows = read_jsonl(run / "stages" / "0-main" / "eval" / "answers" / f"v{step:06d}.jsonl")
    assert len(rows) == EVAL_SIZE
    return [r["reward"] >= 1.0 for r in rows[:first]]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first one run waits for the demo (its warm-up)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_short_rl_run_raises_held_out_accuracy(rl_run: Callable[..., Path],
                                                   algorithm: str) -> None:
    config, extra, metric = ALGORITHMS[algorithm]
    run = rl_run(algorithm, config, *extra)
    steps = PAPER_STEPS if f"trainer.steps={PAPER_STEPS}" in extra else STEPS
    ev = json.loads((run / "summary.json").read_text())["eval"]
    p, b, c = mcnemar_p(final_answers(run, 0), final_answers(run, steps))
    print(f"{algorithm}: held-out accuracy {ev['initial_accuracy']:.3f} -> "
          f"{ev['final_accuracy']:.3f} in {steps} steps; {b} right after only, {c} before "
          f"only, one-sided p = {p:.2g}")
    record(algorithm, before=ev["initial_accuracy"], after=ev["final_accuracy"], b=b, c=c,
           p=p)
    trained = trainer_metrics(run)
    assert len(trained) == steps and all(metric in m for m in trained)
    assert ev["final_accuracy"] > ev["initial_accuracy"] and p < P_MAX, (ev, b, c, p)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_grpo_training_a_rank_8_lora_adapter_raises_held_out_accuracy(
        rl_run: Callable[..., Path]) -> None:
    """The demo's GRPO stage with `model.lora` (rank 8; a LoRA's usual 30x the learning
    rate): on the demo's 500 held-out problems the final adapter's answers beat the starting
    model's by more than noise can (McNemar's exact test, one-sided p < 0.01). Measured on
    the first 200 of them: 56 % -> 70 %, 75 %, 70 % (p = 3e-4, 1e-6, 3e-4) in three runs;
    lr 1e-3 overshoots. At learning seed 1 (one thread, 2026-12-06) one run went 46.5 % ->
    53.5 % (48 wrong -> right, 34 right -> wrong, p = 0.075: the test failed) and a second,
    after the trainer's prompt sharing, 46.5 % -> 63.0 % (p = 8.8e-5): the run is
    asynchronous and its outcome varies, so 200 problems were too few for the bound. On all
    500 (this test), one thread: seed 0 53.4 % -> 71.6 % (141 / 50, p = 1.6e-11), seed 1
    45.2 % -> 59.4 % (128 / 57, p = 9.5e-8), seed 2 44.8 % -> 59.8 % (109 / 34, p = 1.2e-10)
    (tools/learning_table.py; seed 1 from the same run outside it); two threads, seed 1:
    45.2 % -> 61.0 % (130 / 51, p = 1.9e-9)."""
    run = rl_run("grpo-lora", "grpo.yaml", "model.lora={rank: 8}", "trainer.lr=3e-4")
    p, b, c = mcnemar_p(final_answers(run, 0), final_answers(run))
    ev = json.loads((run / "summary.json").read_text())["eval"]
    print(f"grpo + lora rank 8: held-out accuracy {ev['initial_accuracy']:.3f} -> "
          f"{ev['final_accuracy']:.3f}, wrong -> right {b}, right -> wrong {c}, p = {p:.3g}")
    record("grpo + lora", before=ev["initial_accuracy"], after=ev["final_accuracy"], b=b, c=c,
           p=p)
    assert p < 0.01, (ev, b, c)
    manifest = json.loads((run / "stages" / "0-main" / "weights" / f"v{STEPS:06d}" /
                           "manifest.json").read_text())
    assert manifest["kind"] == "lora-adapter" and manifest["adapter"]["r"] == 8


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_four_steps_off_policy_with_correction_learns_as_much_as_one_step_off(
        rl_run: Callable[..., Path]) -> None:
    """GRPO with the explorers up to 4 versions ahead and truncated importance sampling
    learns at least as much as the demo's one step ahead without correction: on the same
    held-out problems (the first 200), McNemar's exact test finds the offset-1 run's final
    answers no better (one-sided p >= 0.01), and the offset-4 run's own gain is beyond noise
    (p < 0.001 against its start, on all 500). Its rollouts were really stale (a batch more than 2
    versions behind, none past the 5 versions the correction keeps), its mismatch metrics
    nonzero, and report.png plots them in a third panel.

    Why 1 % and not 5 %: McNemar's p takes both trained models as fixed and measures only the
    held-out sample's noise, but an asynchronous run's outcome also varies with thread timing
    (which explorer's rollouts fill a batch, how stale they are). With the lag bounded, four
    offset-4 runs reached 74.0, 78.0, 78.5 and 75.0 % against offset 1's 78.0, 77.5, 77.5 and
    78.5 % (p = 0.058, 0.70, 0.86, 0.033): at 5 % one run in four failed on an outcome inside
    offset 4's own spread (docs/algorithms.md)."""
    near = rl_run("grpo", "grpo.yaml")
    # max_staleness 5 = the correction's window ((offset + 1) x interval versions kept): under
    # a loaded suite one explorer ran ahead of the other and rollouts 7 versions old were
    # trained with their log-probs taken under the current weights, not their own (p = 0.026)
    far = rl_run("grpo-offset4-tis", "grpo.yaml", "sync.offset=4", "buffer.max_staleness=5",
                 "algorithm.correction={type: tis, cap: 2.0}")
    p, b, c = mcnemar_p(final_answers(far, first=OFFSET_EVAL_SIZE),
                        final_answers(near, first=OFFSET_EVAL_SIZE))
    gain_p, gained, lost = mcnemar_p(final_answers(far, 0), final_answers(far))
    accuracy = {name: json.loads((run / "summary.json").read_text())["eval"]
                for name, run in (("offset 1", near), ("offset 4 + tis", far))}
    trained = trainer_metrics(far)
    kl = [m["correction/mismatch_kl"] for m in trained]
    lag = max(m["staleness/max"] for m in trained)
    print(json.dumps(accuracy), f"offset 1 right where offset 4 was wrong: {b}, the other "
          f"way: {c}, p = {p:.3g}; staleness max {lag}; mismatch KL {min(kl):.3g} to "
          f"{max(kl):.3g}; offset 4 against its start: {gained} gained, {lost} lost, "
          f"p = {gain_p:.3g}")
    far_ev = accuracy["offset 4 + tis"]
    record("grpo offset 4 + tis", before=far_ev["initial_accuracy"],
           after=far_ev["final_accuracy"], b=gained, c=lost, p=gain_p, p_vs_offset_1=p,
           max_staleness=lag)
    assert 2 < lag <= 5, f"the offset-4 run trained on rollouts at most {lag} versions old"
    assert len(kl) == STEPS and all(k > 0 for k in kl), kl
    assert p >= 0.01, f"offset 1 learned more than offset 4 with correction (p = {p:.3g})"
    assert gain_p < P_MAX, f"offset 4's gain is within noise (p = {gain_p:.3g})"
    # three panels at 100 dpi: the PNG's IHDR width is 1600 px (two panels: 1100)
    png = (far / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1600
    assert int.from_bytes((near / "report.png").read_bytes()[16:20], "big") == 1600


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_student_distilled_on_policy_closes_half_its_gap_to_the_teacher(
        rl_run: Callable[..., Path], demo_run: Path, teacher_model: Path) -> None:
    """On-policy distillation (`on_policy_distill`, docs/algorithms.md): the student is the
    demo's SFT warm-up, the teacher the demo's final weights (the same tiny model after 150
    GRPO steps), scored on the same 500 held-out problems. DISTILL_STEPS steps of the
    student's own rollouts, each token's advantage the teacher's log-prob minus the
    student's, must close at least half of the gap in held-out accuracy; the reverse KL to
    the teacher the explorers record must fall. Distillation compares no rollouts of one
    task, so each step's 64 rollouts go to 64 distinct problems (`explorer.repeat` 1): with
    grpo.yaml's 8 problems x 8, learning seed 2 closed 0.51 of its gap in 20 steps and
    0.46 in 40 (docs/algorithms.md)."""
    run = rl_run("on-policy-distill", "grpo.yaml",
                 f"algorithm={{algorithm_type: on_policy_distill, teacher_model: {teacher_model}}}",
                 "explorer.repeat=1", "explorer.tasks_per_step=32",
                 f"trainer.steps={DISTILL_STEPS}", f"eval.interval={DISTILL_STEPS}")
    steps = json.loads((demo_run / "demo" / "summary.json").read_text())["stages"][-1][
        "trainer_steps"]
    teacher = sum(_demo_correct(demo_run, steps)) / EVAL_SIZE
    before = final_answers(run, 0)
    after = final_answers(run, DISTILL_STEPS)
    start, end = sum(before) / EVAL_SIZE, sum(after) / EVAL_SIZE
    p, b, c = mcnemar_p(before, after)
    kl = [m["teacher_reverse_kl"] for m in read_jsonl(run / "stages" / "0-main" / "metrics" /
                                                       "explorer-0.jsonl") if "step" in m]
    print(f"on-policy distillation: student {start:.3f} -> {end:.3f} in {DISTILL_STEPS} "
          f"steps, teacher {teacher:.3f}: {(end - start) / (teacher - start):.2f} of the gap "
          f"closed; {b} right after only, {c} before only, p = {p:.2g}; reverse KL "
          f"{kl[0]:.3f} -> {kl[-1]:.3f}")
    record("on_policy_distill", before=start, after=end, teacher=teacher, b=b, c=c, p=p)
    trained = trainer_metrics(run)
    assert len(trained) == DISTILL_STEPS and all("teacher_reverse_kl" in m for m in trained)
    assert teacher - start >= 0.1, (start, teacher)  # a teacher better by far more than noise
    assert end - start >= 0.5 * (teacher - start) and p < P_MAX, (start, end, teacher, p)
    assert np.mean(kl[-3:]) < np.mean(kl[:3]), kl
