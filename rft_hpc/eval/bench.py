"""Bench mode: score the base model and every checkpoint of a run on task sets.

`plan_bench` finds the checkpoints and task sets and writes `<out>/bench/plan.json`; bench
task `i` (a Slurm array task or a local process) scores pair `i` of checkpoint x task set
and writes `<out>/bench/<checkpoint>__<taskset>.json` atomically, last, so that a requeued
or repeated task skips what exists; `collect_bench` gathers them into `bench/results.json`.

Checkpoints of a run directory: `base` (the config's model folder), then per stage its
published weights `weights/v<N>` (`<stage>-v<N>`) and the trainer checkpoints
`ckpt/trainer/step-<N>` whose weights were not published (`<stage>-step-<N>`). Of any other
folder: the folder itself when it is a model folder, else each subfolder that is a model
folder (config.json), published weights (manifest.json) or a trainer checkpoint
(model.safetensors); weights are loaded over `model.path`.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rft_hpc.config import ExperimentConfig, load_config
from rft_hpc.config.tasks import ArithmeticTasks, JsonlTasks
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir, atomic_write_json, read_json
from rft_hpc.engines.protocol import InferenceEngine
from rft_hpc.eval.scoring import score_tasks
from rft_hpc.runtime.logs import at_step, setup_logging, step_line
from rft_hpc.tasks.arithmetic import arithmetic_tasks
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task, load_task_file

log = logging.getLogger(__name__)

BENCH_FORMAT_VERSION = 1
PLAN_FILE = "plan.json"
RESULTS_FILE = "results.json"
_VERSION = re.compile(r"v(\d{6,})")
_STEP = re.compile(r"step-(\d{6,})")


@dataclass(frozen=True)
class Checkpoint:
    """Weights to score: a model folder, or weights loaded over the model folder `model`."""

    name: str
    kind: str
    """`model` (a Hugging Face folder), `weights` (weights/v<N>) or `trainer` (step-<N>)."""
    path: str
    model: str


def find_checkpoints(target: Path, config: ExperimentConfig) -> list[Checkpoint]:
    """The checkpoints of a run directory or a folder, in order (see the module's doc)."""
    model = str(config.model.path) if config.model.path else ""
    if (target / "config.yaml").is_file() and model:
        found = [Checkpoint("base", "model", model, model)]
        stages = sorted((target / "stages").glob("*-*"), key=_stage_number)
        for folder in stages or [target]:
            prefix = folder.name.partition("-")[2] if stages else "main"
            found += _stage_checkpoints(RunDir(folder), prefix, model)
        return found
    if (target / "config.json").is_file():
        return [Checkpoint(target.name, "model", str(target), str(target))]
    found = []
    for folder in sorted(p for p in target.iterdir() if p.is_dir()):
        kind = ("model" if (folder / "config.json").is_file() else "weights"
                if (folder / "manifest.json").is_file() else "trainer"
                if (folder / "model.safetensors").is_file() else None)
        if kind is None:
            continue
        if kind != "model" and not model:
            raise UserError(f"{folder} holds weights without a model: give the model folder "
                            "they belong to with --set model.path=MODEL")
        found.append(Checkpoint(folder.name, kind, str(folder), str(folder)
                                if kind == "model" else model))
    return found


def _stage_number(folder: Path) -> int:
    head = folder.name.partition("-")[0]
    return int(head) if head.isdigit() else 0


def _stage_checkpoints(run: RunDir, stage: str, model: str) -> list[Checkpoint]:
    versions = {int(m.group(1)): p for p in run.weights.glob("v*")
                if (m := _VERSION.fullmatch(p.name)) and (p / "manifest.json").exists()}
    steps = {int(m.group(1)): p for p in (run.ckpt / "trainer").glob("step-*")
             if (m := _STEP.fullmatch(p.name)) and (p / "model.safetensors").exists()}
    found = {v: Checkpoint(f"{stage}-{p.name}", "weights", str(p), model)
             for v, p in versions.items()}
    for step, p in steps.items():
        found.setdefault(step, Checkpoint(f"{stage}-{p.name}", "trainer", str(p), model))
    return [found[v] for v in sorted(found)]


def parse_taskset(spec: str, config: ExperimentConfig) -> dict[str, Any]:
    """A task set from its `--tasks` spec: `eval` (the config's eval split),
    `arithmetic[:digits=D,ops=OPS,size=N]` (held-out generated problems) or a JSONL file."""
    kind, _, args = spec.partition(":")
    if spec == "eval":
        return {"name": "eval", "source": config.tasks.model_dump(mode="json")}
    if kind == "arithmetic":
        try:
            opts = dict(a.split("=", 1) for a in args.split(",") if a)
            digits = int(opts.pop("digits", 2))
            ops = opts.pop("ops", "+")
            size = int(opts.pop("size", 0)) or None
        except ValueError:
            raise UserError(f"--tasks {spec}: expected arithmetic:digits=D,ops=OPS,size=N"
                            ) from None
        if opts:
            raise UserError(f"--tasks {spec}: unknown key(s) {', '.join(sorted(opts))}")
        if size is None:
            total = len(arithmetic_tasks(digits, ops, 1, 0)[0]) + 1
            size = min(500, total // 2)
        source = ArithmeticTasks(digits=digits, ops=ops, eval_size=size)
        return {"name": f"arith{digits}{_safe(ops)}", "source": source.model_dump(mode="json")}
    path = Path(spec).resolve()
    if path.suffix != ".jsonl" or not path.is_file():
        raise UserError(f"--tasks {spec}: not `eval`, `arithmetic:...` nor a .jsonl file")
    return {"name": _safe(path.stem), "source": {"type": "jsonl", "path": str(path)}}


def load_taskset(taskset: dict[str, Any], seed: int) -> list[Task]:
    """The tasks of a task set from `parse_taskset`."""
    source = taskset["source"]
    if source["type"] == "arithmetic":
        return build_tasks(ArithmeticTasks(**source), seed)[1]
    if "eval_path" in source:  # the config's own JSONL source: its eval split
        tasks = build_tasks(JsonlTasks(**source), seed)[1]
        if not tasks:
            raise UserError("the config's tasks have no eval_path: no eval split to score")
        return tasks
    return load_task_file(Path(source["path"]))


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", lambda m: {"+": "p", "-": "m", "*": "x"}.get(
        m.group(0), "_"), text)


def bench_config(target: Path, overrides: list[str]) -> ExperimentConfig:
    """The settings of a bench: the run's config (a run directory) or the defaults, with
    the `--set` overrides."""
    target = target.resolve()
    source = target / "config.yaml" if (target / "config.yaml").is_file() else Path(
        "/dev/null")
    return load_config(source, overrides)


def plan_bench(target: Path, specs: list[str], out: Path, *, k: int, n: int | None,
               config: ExperimentConfig, overrides: list[str] = ()) -> dict[str, Any]:
    """Find the checkpoints and task sets, write `<out>/bench/plan.json`, return the plan
    (sampling and generation settings from `config`; `overrides`, its `--set`s, are kept
    for the Slurm jobs)."""
    target = target.resolve()
    if not target.is_dir():
        raise UserError(f"{target} is not a folder")
    checkpoints = find_checkpoints(target, config)
    if not checkpoints:
        raise UserError(f"{target} holds no checkpoints (weights/v<N>, ckpt/trainer/step-<N>"
                        ", model folders)")
    tasksets = [parse_taskset(s, config) for s in specs or ["eval"]]
    if len({t["name"] for t in tasksets}) < len(tasksets):
        raise UserError("two --tasks name the same task set")
    samples = n if n is not None else k
    if k < 1 or samples < k:
        raise UserError(f"--k {k} needs 1 <= k <= --n ({samples})")
    plan = {"format_version": BENCH_FORMAT_VERSION, "target": str(target),
            "checkpoints": [asdict(c) for c in checkpoints], "tasksets": tasksets,
            "k": k, "n": samples, "temperature": config.explorer.temperature or 1.0,
            "max_new_tokens": config.eval.max_new_tokens,
            "batch_size": config.eval.batch_size, "seed": config.run.seed,
            "dtype": config.model.dtype, "threads": config.trainer.threads,
            "engine": config.explorer.engine,
            "vllm": config.explorer.vllm.model_dump(mode="json"),
            "lora": None if config.model.lora is None else config.model.lora.model_dump(
                mode="json"),
            "prompt": config.prompt.model_dump(mode="json"),
            "overrides": overrides}
    folder = out.resolve() / "bench"
    if (folder / PLAN_FILE).exists():
        _check_same_settings(read_json(folder / PLAN_FILE), plan, folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / PLAN_FILE, plan)
    return plan


_SETTINGS = ("k", "n", "temperature", "max_new_tokens", "seed", "dtype", "prompt")


def _check_same_settings(old: dict[str, Any], new: dict[str, Any], folder: Path) -> None:
    """Results already in `folder` are reused: refuse a plan that would score differently."""
    changed = [key for key in _SETTINGS if old.get(key) != new[key]]
    sources = {t["name"]: t["source"] for t in old["tasksets"]}
    changed += [f"task set {t['name']}" for t in new["tasksets"]
                if sources.get(t["name"], t["source"]) != t["source"]]
    if changed:
        raise UserError(f"{folder} holds results scored with other settings "
                        f"({', '.join(changed)}): choose another --out, or delete it")


def task_count(plan: dict[str, Any]) -> int:
    """Bench tasks of a plan: one per checkpoint and task set."""
    return len(plan["checkpoints"]) * len(plan["tasksets"])


def result_file(folder: Path, plan: dict[str, Any], index: int) -> Path:
    """Where bench task `index` leaves its scores."""
    checkpoint, taskset = _pair(plan, index)
    return folder / f"{checkpoint['name']}__{taskset['name']}.json"


def _pair(plan: dict[str, Any], index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    if not 0 <= index < task_count(plan):
        raise UserError(f"bench task {index} does not exist: the plan has {task_count(plan)}")
    per = len(plan["tasksets"])
    return plan["checkpoints"][index // per], plan["tasksets"][index % per]


def run_bench_task(folder: Path, index: int) -> dict[str, Any]:
    """Score pair `index` of the plan in `folder` (a bench folder); once: a rerun returns
    the result already written. Logs one line: step `index + 1` of the plan's tasks."""
    from rft_hpc.runtime.common import set_threads

    setup_logging("bench")
    plan = read_json(folder / PLAN_FILE)
    out = result_file(folder, plan, index)
    if out.exists():
        log.info("bench task %d was scored already: %s", index, out)
        return read_json(out)
    checkpoint, taskset = _pair(plan, index)
    at_step(index + 1)
    set_threads(plan["threads"])
    t0 = time.monotonic()
    tasks = load_taskset(taskset, plan["seed"])
    engine = load_checkpoint(Checkpoint(**checkpoint), plan)
    try:
        scores = score_tasks(engine, tasks, k=plan["k"], n=plan["n"],
                             temperature=plan["temperature"],
                             max_new_tokens=plan["max_new_tokens"],
                             batch_size=plan["batch_size"], seed=plan["seed"])
    finally:
        if hasattr(engine, "close"):
            engine.close()
    result = {"format_version": BENCH_FORMAT_VERSION, "checkpoint": checkpoint["name"],
              "path": checkpoint["path"], "taskset": taskset["name"], **scores,
              "seconds": round(time.monotonic() - t0, 3)}
    atomic_write_json(out, result)
    at_step(None)
    log.info(bench_line(result, index + 1, task_count(plan)))
    return result


def bench_line(result: dict[str, Any], step: int, total: int) -> str:
    """The log line of one scored bench task (its checkpoint as the version, greedy
    accuracy as the reward)."""
    return step_line(step, total, version=result["checkpoint"],
                     reward=result["greedy_accuracy"], seconds=result["seconds"],
                     taskset=result["taskset"])


def load_checkpoint(checkpoint: Checkpoint, plan: dict[str, Any]) -> InferenceEngine:
    """An engine holding the checkpoint's weights, in the plan's prompt format: vLLM when
    the plan's `engine` is (the run's explorers used it), else transformers (on the GPU, if
    there is one)."""
    import torch

    from rft_hpc.config.lora import LoraSettings
    from rft_hpc.config.prompt import PromptConfig
    from rft_hpc.models.lora import peft_names
    from rft_hpc.sync.storage import load_safetensors
    from rft_hpc.sync.weight_files import load_weights

    prompt = PromptConfig(**plan.get("prompt", {}))
    # a LoRA run's versions and checkpoints are adapters over the model folder
    lora = LoraSettings(**plan["lora"]) if plan.get("lora") else None
    if plan.get("engine") == "vllm":
        from rft_hpc.config.schema import VLLMConfig
        from rft_hpc.engines.vllm import VLLMEngine

        engine: InferenceEngine = VLLMEngine(checkpoint.model, dtype=plan["dtype"],
                                 settings=VLLMConfig(**plan.get("vllm", {})),
                                 seed=plan["seed"], prompt=prompt, lora=lora)
    else:
        from rft_hpc.engines.hf import HFEngine

        engine = HFEngine(checkpoint.model, dtype=plan["dtype"], prompt=prompt,
                          device="cuda" if torch.cuda.is_available() else "cpu", lora=lora)
    path = Path(checkpoint.path)
    if checkpoint.kind == "weights":
        engine.load_weights(load_weights(path.parent, int(path.name[1:])), 0)
    elif checkpoint.kind == "trainer":
        state = load_safetensors(path / "model.safetensors")[0]
        engine.load_weights(peft_names(state) if lora is not None else state, 0)
    return engine


def collect_bench(folder: Path) -> dict[str, Any]:
    """Gather every bench task's scores into `results.json` (a `UserError` naming the
    missing ones if any task has not written its file)."""
    plan = read_json(folder / PLAN_FILE)
    files = [result_file(folder, plan, i) for i in range(task_count(plan))]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise UserError(f"{len(missing)} bench result(s) missing in {folder}: "
                        f"{', '.join(missing[:5])}")
    results = {"format_version": BENCH_FORMAT_VERSION, "target": plan["target"],
               "k": plan["k"], "n": plan["n"],
               "checkpoints": [c["name"] for c in plan["checkpoints"]],
               "tasksets": [t["name"] for t in plan["tasksets"]],
               "results": [read_json(f) for f in files]}
    atomic_write_json(folder / RESULTS_FILE, results)
    return results
