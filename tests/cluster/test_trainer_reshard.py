"""Resharded resume: a trainer run saved by 2 ranks resumes on 1 and on 4 ranks (ddp and
fsdp) and ends with the weights of an uninterrupted run on that many ranks.

Real processes over gloo: the four tasks of one job on the local Slurm cluster, each of
which runs the trainer role on several stages in turn (a process group for each, of 1, 2 or
all 4 tasks), which keeps the test cheap: four processes start, not eleven.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from helpers.ranks import rank_env, write_config
from helpers.slurm_cluster import sbatch, wait_for_states

from rft_hpc.sync.storage import load_safetensors
from rft_hpc.trainer.distributed import ENV_INIT_FILE

STEPS, SAVED = 4, 2


def stage(tmp_path: Path, model: Path, name: str, parallel: str) -> Path:
    """An offline SFT stage of `STEPS` steps saved every `SAVED`, with a warm-up and a cosine
    schedule (a resumed run must continue its curve); prepared as `rft-hpc run` does."""
    from rft_hpc.config import load_config
    from rft_hpc.run.stages import prepare_model, prepare_stage

    path = write_config(tmp_path / f"{name}.yaml", model, mode="train",
                        data={"source": "tasks"}, algorithm={"algorithm_type": "sft"},
                        trainer={"lr": 3e-4, "batch_size": 12, "steps": STEPS,
                                 "save_interval": SAVED, "keep_checkpoints": 3,
                                 "warmup_steps": 1, "lr_schedule": "cosine",
                                 "parallel": parallel, "micro_batch_tokens": 64},
                        tasks={"type": "arithmetic", "digits": 1, "eval_size": 1},
                        eval={"interval": 0, "max_new_tokens": 1})
    folder = tmp_path / name
    prepare_stage(prepare_model(load_config(path)), folder, None)
    return folder


def rewound(source: Path, name: str) -> Path:
    """A copy of a finished stage as a trainer killed right after its step-`SAVED` save
    leaves it: LATEST names that checkpoint, later ones and the final weights are gone."""
    folder = source.parent / name
    shutil.copytree(source, folder)
    for step in range(SAVED + 1, STEPS + 1):
        shutil.rmtree(folder / "ckpt" / "trainer" / f"step-{step:06d}", ignore_errors=True)
    shutil.rmtree(folder / "weights")
    (folder / "ckpt" / "LATEST").write_text(f"trainer/step-{SAVED:06d}\n")
    return folder


def final(folder: Path) -> dict[str, torch.Tensor]:
    """The model weights of a stage's last checkpoint."""
    return load_safetensors(folder / "ckpt" / "trainer" / f"step-{STEPS:06d}" /
                            "model.safetensors")[0]


def saved_ranks(folder: Path, step: int) -> dict:
    """`state.json`'s record of the ranks that saved a stage's checkpoint of `step`."""
    state = folder / "ckpt" / "trainer" / f"step-{step:06d}" / "state.json"
    return json.loads(state.read_text())["ranks"]


PARALLEL = ("ddp", "fsdp")


def test_a_two_rank_run_resumes_on_one_and_on_four_ranks(tmp_path, tiny_model, slurm_env):
    runs = {f"{p}-{n}": stage(tmp_path, tiny_model, f"{p}-{n}", p)
            for p in PARALLEL for n in (1, 2, 4)}
    env = {**rank_env(0, 4, tmp_path / "unused"), **slurm_env}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the worker sets them, or Slurm does
        env.pop(name)
    job = sbatch(["-N2", "-n4", "--mem=0", "--output=job.log", "--wrap",
                  f"srun {sys.executable} {__file__} tasks {tmp_path}"], env, cwd=tmp_path)
    states = wait_for_states(job, slurm_env, timeout=600)
    log = (tmp_path / "job.log").read_text()
    assert states == {job: "COMPLETED"}, log[-5000:]
    assert "4 ranks over gloo" in log and "2 ranks over gloo" in log

    for p in PARALLEL:
        two = runs[f"{p}-2"]
        assert saved_ranks(two, SAVED) == {"world_size": 2, "backend": p, "model_parallel": 1}
        assert saved_ranks(tmp_path / f"{p}-2to4", STEPS)["world_size"] == 4
        assert saved_ranks(tmp_path / f"{p}-2to1", STEPS) == {
            "world_size": 1, "backend": "ddp", "model_parallel": 1}  # one rank: no shards
        for n, now in ((4, p), (1, "ddp")):
            assert f"resuming step {SAVED} saved by 2 rank(s) ({p}, model-parallel 1) on {n} " \
                f"rank(s) ({now}, model-parallel 1)" in log
            alone, again = final(runs[f"{p}-{n}"]), final(tmp_path / f"{p}-2to{n}")
            assert sorted(again) == sorted(alone)
            diff = max(float((again[k] - alone[k]).abs().max()) for k in alone)
            noise = max(float((alone[k] - final(two)[k]).abs().max()) for k in alone)
            print(f"{p}: saved by 2 ranks, resumed on {n}: max |weight diff| {diff:.3g} against "
                  f"{n} rank(s) throughout ({noise:.3g} between {n} and 2 ranks throughout)")
            for k, w in alone.items():
                torch.testing.assert_close(again[k], w, rtol=0, atol=1e-5, msg=k)
        middle = load_safetensors(two / "ckpt" / "trainer" / f"step-{SAVED:06d}" /
                                  "model.safetensors")[0]
        moved = max(float((final(two)[k] - w).abs().max()) for k, w in middle.items())
        assert moved > 1e-4  # the steps after the save move weights 10 times the tolerance
    optimizer = torch.load(runs["ddp-2"] / "ckpt" / "trainer" / f"step-{SAVED:06d}" /
                           "optimizer.pt")
    assert sorted(optimizer["state"]) == sorted(final(runs["ddp-1"]))  # keyed by name


def run_stages(folders: list[Path], rank: int, world: int) -> None:
    """The trainer role on each stage in turn, as `rank` of `world` (a world of 4: the Slurm
    tasks themselves), meeting the other ranks through a rendezvous file of that stage."""
    from rft_hpc.trainer.role import run_trainer

    if world < 4:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    for folder in folders:
        os.environ[ENV_INIT_FILE] = str(folder / "state" / f"dist-{world}")
        run_trainer(folder)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)


def barrier(root: Path, name: str, task: int, tasks: int = 4) -> None:
    """Wait until every Slurm task of the job has reached `name`."""
    (root / f"{name}.{task}").touch()
    deadline = time.monotonic() + 300
    while not all((root / f"{name}.{i}").exists() for i in range(tasks)):
        assert time.monotonic() < deadline, f"task {task}: the others never reached {name}"
        time.sleep(0.05)


def tasks(root: Path) -> None:
    """One of the job's four Slurm tasks: tasks 0 and 1 run the 2-rank stages while 2 and 3
    run the 1-rank ones; task 0 rewinds copies of the 2-rank stages to their step-`SAVED`
    checkpoint; all four run the 4-rank stages; then tasks 0 and 1 resume the copies alone."""
    task = int(os.environ["SLURM_PROCID"])
    if task < 2:
        run_stages([root / f"{p}-2" for p in PARALLEL], task, 2)
    else:
        run_stages([root / f"{PARALLEL[task - 2]}-1"], 0, 1)
    barrier(root, "trained", task)
    if task == 0:
        for p in PARALLEL:
            for n in (1, 4):
                rewound(root / f"{p}-2", f"{p}-2to{n}")
    barrier(root, "rewound", task)
    run_stages([root / name for p in PARALLEL for name in (f"{p}-4", f"{p}-2to4")], task, 4)
    if task < 2:
        run_stages([root / f"{PARALLEL[task]}-2to1"], 0, 1)


if __name__ == "__main__" and sys.argv[1] == "tasks":
    from rft_hpc.runtime.exit import leave_process

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tasks(Path(sys.argv[2]))
    leave_process(0)  # as `rft-hpc role trainer` ends
