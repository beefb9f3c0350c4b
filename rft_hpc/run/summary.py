"""The end of a run: `summary.json` (the figures) and `report.png` (the curves)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rft_hpc.config import load_config
from rft_hpc.core.rundir import RunDir, atomic_write_json
from rft_hpc.eval.results import evaluation_results
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.run.stages import StageSeconds, finished_stages

SUMMARY_VERSION = 1
_EVAL_KEYS = ("version", "taskset", "metric", "accuracy", "tasks")


def write_summary(run: RunDir, stages: list[dict[str, Any]], *,
                  wall_seconds: float) -> dict[str, Any]:
    """Write `<run>/summary.json` from the stage results and return it.

    `eval.initial_accuracy` is measured at the start of the first stage that explores (the
    RL stage, after any warm-up), `eval.final_accuracy` at the end of the last stage;
    `evaluator` lists the evaluator's scores (stage, weights version, accuracy).
    """
    rl = next((s for s in stages if s["mode"] == "both"), stages[0])
    summary = {
        "summary_version": SUMMARY_VERSION,
        "run": run.root.name,
        "eval": {"initial_accuracy": rl["eval_initial"],
                 "final_accuracy": stages[-1]["eval_final"],
                 "base_accuracy": stages[0]["eval_initial"]},
        "trainer": {"steps": sum(s["trainer_steps"] for s in stages)},
        "explorer": {"steps": sum(s["explorer_steps"] for s in stages)},
        "seconds": {**{s["name"]: round(s["seconds"], 2) for s in stages},
                    "launcher_wall": round(wall_seconds, 2)},
        "stages": stages,
        "evaluator": [{"stage": s["name"], **{k: r[k] for k in _EVAL_KEYS}}
                      for index, s in enumerate(stages)
                      for r in evaluation_results(run.stage(index, s["name"]))],
    }
    atomic_write_json(run.summary, summary)
    return summary


def finalize_run(run: RunDir, seconds: StageSeconds, *, wall_seconds: float) -> dict[str, Any]:
    """Finish every stage still without a result, then write summary.json and report.png
    (the last job of a batch run; `rft-hpc run` does the same at its end)."""
    config = load_config(run.config)
    results = finished_stages(config, run, len(config.stage_configs()), seconds)
    summary = write_summary(run, results, wall_seconds=wall_seconds)
    write_report(run, results)
    return summary


def write_report(run: RunDir, stages: list[dict[str, Any]]) -> Path:
    """Plot explorer reward and held-out accuracy against trainer step to `report.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    offset = 0
    for index, stage in enumerate(stages):
        folder = run.stage(index, stage["name"])
        trainer = read_metrics(folder.metrics_file("trainer"))
        evals = [(offset + r["step"], r["eval_accuracy"]) for r in trainer
                 if r.get("eval_accuracy") is not None]
        if evals:
            ax_e.plot(*zip(*evals, strict=True), marker="o", label=stage["name"])
        rewards = [(offset + r["step"], r["reward_mean"]) for r in trainer
                   if r.get("reward_mean") is not None]
        if rewards:
            ax_r.plot(*zip(*rewards, strict=True), label=stage["name"])
        offset += stage["trainer_steps"]
        if index < len(stages) - 1:
            for ax in (ax_r, ax_e):
                ax.axvline(offset, color="grey", linestyle=":")
    ax_r.set(title="reward of the trained batch", xlabel="trainer step (all stages)",
             ylabel="mean reward")
    ax_e.set(title="held-out accuracy (task rewards)", xlabel="trainer step (all stages)",
             ylabel="accuracy", ylim=(0, 1))
    for ax in (ax_r, ax_e):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run.report
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
