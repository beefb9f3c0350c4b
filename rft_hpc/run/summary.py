"""The end of a run: `summary.json` (the figures) and `report.png` (the curves)."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rft_hpc.config import load_config
from rft_hpc.core.rundir import RunDir, atomic_write_bytes, atomic_write_json
from rft_hpc.eval.results import evaluation_results
from rft_hpc.eval.scoring import gold_pairs
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.run.stages import StageSeconds, finished_stages

if TYPE_CHECKING:
    from matplotlib.axes import Axes

SUMMARY_VERSION = 1
_EVAL_KEYS = ("version", "taskset", "metric", "accuracy", "tasks")
_MISMATCH = "correction/mismatch_kl"
_STALENESS = "staleness/mean"
_GOLD_MEAN = re.compile(r"eval_gold_mean@(\d+)_final")


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
    if "eval_gold_final" in stages[-1]:  # the trained reward and the gold one, side by side
        summary["eval"].update({f"{when}_{what}": stage.get(f"{key}_{when}")
                                for key, what in gold_pairs(_sampled_k(stages)).items()
                                for when, stage in (("initial", rl), ("final", stages[-1]))})
    atomic_write_json(run.summary, summary)
    return summary


def _sampled_k(stages: list[dict[str, Any]]) -> int:
    """The `eval.k` of the stages whose results report the gold reward of samples (their
    `eval_gold_mean@<k>_final`); 0 when none does."""
    for stage in reversed(stages):
        for key in stage:
            found = _GOLD_MEAN.fullmatch(key)
            if found:
                return int(found[1])
    return 0


def finalize_run(run: RunDir, seconds: StageSeconds, *, wall_seconds: float) -> dict[str, Any]:
    """Finish every stage still without a result, then write summary.json and report.png
    (the last job of a batch run; `rft-hpc run` does the same at its end)."""
    config = load_config(run.config)
    results = finished_stages(config, run, len(config.stage_configs()), seconds)
    summary = write_summary(run, results, wall_seconds=wall_seconds)
    write_report(run, results)
    return summary


def write_report(run: RunDir, stages: list[dict[str, Any]]) -> Path:
    """Plot explorer reward and held-out accuracy against trainer step to `report.png`, and,
    when a stage logged them, the off-policy metrics: the mismatch KL between the engine's
    and the trainer's log-probs (`algorithm.correction`) and the mean staleness of the
    trained rollouts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    golds = gold_pairs(_sampled_k(stages))
    series: dict[str, list[tuple[str, list[tuple[int, float]]]]] = {
        "reward_mean": [], "eval_accuracy": [], _MISMATCH: [], _STALENESS: [],
        **{key: [] for key in golds}}
    offset, boundaries = 0, []
    for index, stage in enumerate(stages):
        trainer = read_metrics(run.stage(index, stage["name"]).metrics_file("trainer"))
        for key, lines in series.items():
            points = [(offset + r["step"], r[key]) for r in trainer if r.get(key) is not None]
            if points:
                lines.append((stage["name"], points))
        offset += stage["trainer_steps"]
        if index < len(stages) - 1:
            boundaries.append(offset)
    off_policy = bool(series[_MISMATCH] or series[_STALENESS])
    tools = _tool_rates(run, stages)
    gold = bool(series["eval_gold"])  # the gold panel: with `eval.gold`
    panels = 2 + off_policy + bool(tools) + gold
    fig, axes = plt.subplots(1, panels, figsize=(11 + 5 * (panels - 2), 4))
    ax_r, ax_e = axes[0], axes[1]
    for name, points in series["reward_mean"]:
        ax_r.plot(*zip(*points, strict=True), label=name)
    for name, points in series["eval_accuracy"]:
        ax_e.plot(*zip(*points, strict=True), marker="o", label=name)
    ax_r.set(title="reward of the trained batch", xlabel="trainer step (all stages)",
             ylabel="mean reward")
    ax_e.set(title="held-out accuracy (task rewards)", xlabel="trainer step (all stages)",
             ylabel="accuracy", ylim=(0, 1))
    if off_policy:
        _plot_off_policy(axes[2], series[_MISMATCH], series[_STALENESS])
    if tools:
        _plot_tools(axes[2 + off_policy], tools)
    if gold:
        _plot_gold(axes[-1], {golds[key]: series[key] for key in golds}, boundaries)
    for ax in axes[:2 + off_policy]:  # trainer steps: the stage boundaries
        for x in boundaries:
            ax.axvline(x, color="grey", linestyle=":")
        ax.grid(alpha=0.3)
    for ax in (ax_r, ax_e):  # the off-policy panel has its own, with its twin axis
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    path = run.report
    image = io.BytesIO()  # written as every shared file is: whole, under a temporary name
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, image.getvalue(), durable=False)
    return path


def _plot_off_policy(ax: Axes, mismatch: list[tuple[str, list[tuple[int, float]]]],
                     staleness: list[tuple[str, list[tuple[int, float]]]]) -> None:
    """The mismatch KL on a log axis (it spans orders of magnitude; steps where the engine
    and the trainer agreed exactly, KL 0, have no point) and the staleness on a second
    axis."""
    for name, points in mismatch:
        positive = [(step, v) for step, v in points if v > 0]
        if positive:
            ax.plot(*zip(*positive, strict=True), color="tab:red", marker=".",
                    label=f"mismatch KL ({name})")
    ax.set(title="off-policy: engine vs trainer, staleness", xlabel="trainer step (all stages)",
           ylabel="mismatch KL (k3, token mean)")
    if any(v > 0 for _, points in mismatch for _, v in points):
        ax.set_yscale("log")
    if staleness:
        twin = ax.twinx()
        for name, points in staleness:
            twin.plot(*zip(*points, strict=True), color="tab:blue", alpha=0.6,
                      label=f"staleness mean ({name})")
        twin.set_ylabel("versions behind (mean)")
        twin.set_ylim(bottom=0)
        handles, labels = twin.get_legend_handles_labels()
        own = ax.get_legend_handles_labels()
        ax.legend(own[0] + handles, own[1] + labels, loc="best", fontsize="small")
    elif mismatch:
        ax.legend(loc="best", fontsize="small")


_TOOL_RATES = {"tools/success_rate": "tool calls that succeeded",
               "tools/malformed_rate": "tool calls malformed"}


def _tool_rates(run: RunDir, stages: list[dict[str, Any]],
                ) -> dict[str, list[tuple[int, float]]]:
    """Each tool-call rate the explorers logged (`explorer.overrollout.tool_metrics`)
    against the explorer step over all stages; empty when no policy called a tool."""
    rates: dict[str, list[tuple[int, float]]] = {key: [] for key in _TOOL_RATES}
    offset = 0
    for index, stage in enumerate(stages):
        rows = [r for path in sorted(run.stage(index, stage["name"]).metrics.glob(
            "explorer-*.jsonl")) for r in read_metrics(path)]
        for key, points in rates.items():
            points += [(offset + r["step"], r[key]) for r in rows if r.get(key) is not None]
        offset += max((r["step"] + 1 for r in rows), default=0)
    return {key: sorted(points) for key, points in rates.items() if points}


def _plot_tools(ax: Axes, rates: dict[str, list[tuple[int, float]]]) -> None:
    """The tool-call success and malformed-call rates per explorer step."""
    for key, points in rates.items():
        ax.plot(*zip(*points, strict=True), marker=".", label=_TOOL_RATES[key])
    ax.set(title="tool calls", xlabel="explorer step (all stages)", ylabel="share of calls",
           ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def _plot_gold(ax: Axes, lines: dict[str, list[tuple[str, list[tuple[int, float]]]]],
               boundaries: list[int]) -> None:
    """The held-out answers' mean task reward (what training optimises, e.g. a reward
    model's score) and mean gold reward (`eval.gold`) against the trainer step, `lines` by
    their summary names (`reward`, `gold`: greedy answers; `reward_mean@k`, `gold_mean@k`:
    samples): a reward that rises while the gold one does not is reward hacking."""
    for what, stages in lines.items():
        label = what.replace("reward", "trained reward")
        for name, points in stages:
            ax.plot(*zip(*points, strict=True), "--" if "gold" in what else "-",
                    marker="o" if "@" not in what else "s", label=f"{label} ({name})")
    for x in boundaries:
        ax.axvline(x, color="grey", linestyle=":")
    ax.set(title="held-out reward: trained and gold", xlabel="trainer step (all stages)",
           ylabel="mean reward (greedy answers; @k: samples)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
