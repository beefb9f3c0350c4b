"""Resharded resume: a trainer run saved by 2 ranks resumes on 1 and on 4 ranks (ddp and
fsdp) and ends with the weights of an uninterrupted run on that many ranks.

Real processes over gloo: the 2-rank runs and the 1-rank runs are local processes, the
4-rank runs four tasks of one job on the local Slurm cluster. Each process runs the trainer
role on several stages in turn (one process group each), which keeps the test cheap.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from helpers.paths import ROOT
from helpers.ranks import finish, rank_env, start_ranks, write_config
from helpers.slurm_cluster import sbatch, wait_for_states

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
    from rft_hpc.sync.storage import load_safetensors

    return load_safetensors(folder / "ckpt" / "trainer" / f"step-{STEPS:06d}" /
                            "model.safetensors")[0]


def saved_ranks(folder: Path, step: int) -> dict:
    """`state.json`'s record of the ranks that saved a stage's checkpoint of `step`."""
    state = folder / "ckpt" / "trainer" / f"step-{step:06d}" / "state.json"
    return json.loads(state.read_text())["ranks"]


def command(*stages: Path) -> list[str]:
    return [sys.executable, __file__, "stages", *map(str, stages)]


def test_a_two_rank_run_resumes_on_one_and_on_four_ranks(tmp_path, tiny_model, slurm_env):
    runs = {f"{p}-{n}": stage(tmp_path, tiny_model, f"{p}-{n}", p)
            for p in ("ddp", "fsdp") for n in (1, 2, 4)}
    first = start_ranks(command(runs["ddp-2"], runs["fsdp-2"]), 2, tmp_path / "unused")
    first += start_ranks(command(runs["ddp-1"], runs["fsdp-1"]), 1, None)
    results = finish(first)
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]

    resumed = {f"{p}-2to{n}": rewound(runs[f"{p}-2"], f"{p}-2to{n}")
               for p in ("ddp", "fsdp") for n in (1, 4)}
    env = {**rank_env(0, 4, tmp_path / "unused"), **slurm_env}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the ranks come from Slurm
        env.pop(name)
    wrap = "srun " + " ".join(command(runs["ddp-4"], resumed["ddp-2to4"], runs["fsdp-4"],
                                      resumed["fsdp-2to4"]))
    job = sbatch(["-N2", "-n4", "--mem=0", "--output=four.log", "--wrap", wrap], env,
                 cwd=tmp_path)
    one = subprocess.run(command(resumed["ddp-2to1"], resumed["fsdp-2to1"]), cwd=ROOT,
                         env=rank_env(0, 1, None), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    states = wait_for_states(job, slurm_env, timeout=300)
    four = (tmp_path / "four.log").read_text()
    assert states == {job: "COMPLETED"}, four[-3000:]
    assert "4 ranks over gloo" in four

    for p in ("ddp", "fsdp"):
        assert saved_ranks(runs[f"{p}-2"], SAVED) == {
            "world_size": 2, "backend": p, "model_parallel": 1}
        assert saved_ranks(resumed[f"{p}-2to4"], STEPS)["world_size"] == 4
        assert saved_ranks(resumed[f"{p}-2to1"], STEPS) == {
            "world_size": 1, "backend": "ddp", "model_parallel": 1}  # one rank: no shards
        assert f"resuming step {SAVED} saved by 2 rank(s) ({p}, model-parallel 1) on 4 " \
            f"rank(s) ({p}, model-parallel 1)" in four
        assert f"resuming step {SAVED} saved by 2 rank(s) ({p}, model-parallel 1) on 1 " \
            "rank(s) (ddp, model-parallel 1)" in one.stderr
        start = final(runs[f"{p}-2"])  # the 2-rank run itself went on to the end
        for n in (1, 4):
            alone, again = final(runs[f"{p}-{n}"]), final(resumed[f"{p}-2to{n}"])
            assert sorted(again) == sorted(alone)
            diff = max(float((again[k] - alone[k]).abs().max()) for k in alone)
            moved = max(float((alone[k] - start[k]).abs().max()) for k in alone)
            print(f"{p}: saved by 2 ranks, resumed on {n}: max |weight diff| {diff:.3g} "
                  f"against {n} rank(s) throughout ({moved:.3g} against 2 ranks throughout)")
            for k, w in alone.items():
                torch.testing.assert_close(again[k], w, rtol=0, atol=1e-5, msg=k)
    # one rank trains the same way whatever trainer.parallel says
    assert all(torch.equal(w, final(runs["fsdp-1"])[k]) for k, w in final(runs["ddp-1"]).items())
    optimizer = torch.load(runs["ddp-2"] / "ckpt" / "trainer" / f"step-{SAVED:06d}" /
                           "optimizer.pt")
    assert sorted(optimizer["state"]) == sorted(final(runs["ddp-1"]))  # keyed by name


def run_stages(stages: list[str]) -> None:
    """One rank (a local process or a Slurm task): the trainer role on each stage in turn,
    meeting the other ranks through a rendezvous file of that stage."""
    from rft_hpc.trainer.role import run_trainer

    for folder in map(Path, stages):
        if os.environ.get(ENV_INIT_FILE):
            os.environ[ENV_INIT_FILE] = str(folder / "state" / "dist-test")
        run_trainer(folder)


if __name__ == "__main__" and sys.argv[1] == "stages":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_stages(sys.argv[2:])
