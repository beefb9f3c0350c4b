"""`rft-hpc submit | render | status | cancel | logs` on the real local Slurm cluster
(tools/local-slurm.sh): the demo experiment as a graph of Slurm jobs running the same role
commands as `rft-hpc run`.

The golden scripts in tests/golden/ are rewritten by running this file with
RFT_UPDATE_GOLDEN=1 (then review the diff).
"""

from __future__ import annotations

import grp
import json
import os
import secrets
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.paths import DEMO, GOLDEN, ROOT
from helpers.runs import EVALUATOR, scores_match_trainer, short
from helpers.slurm_cluster import slurm, wait_for_states
from helpers.slurm_runs import jobs_in_queue, rft, status, unique, wait_for_run

from rft_hpc.config import launch as launch_config
from rft_hpc.core.config_section import ConfigSection

SUMMARY_KEYS = {"summary_version", "run", "eval", "trainer", "explorer", "seconds", "stages",
                "evaluator"}


def test_every_launch_setting_is_documented() -> None:
    models = [m for m in vars(launch_config).values() if isinstance(m, type)
              and issubclass(m, ConfigSection) and m.__module__ == launch_config.__name__]
    undocumented = [f"{m.__name__}.{name}" for m in models
                    for name, field in m.model_fields.items() if not field.description]
    assert len(models) >= 4 and undocumented == []


GOLDEN_SETTINGS = [
    "launch.python=/site/venv/bin/python", "launch.umask='0027'", "launch.slurm.signal_delay=300",
    "launch.slurm.explorer={partition: cpu, time: '00:20:00', mem: 4G, cpus_per_task: 2, "
    "array_parallelism: 1, extra: [--requeue]}",
    "launch.slurm.trainer={partition: gpu, account: proj, qos: normal, gpus_per_node: 1, "
    "time: '01:00:00', exclusive: true, constraint: a100, setup: ['module load cuda/12'], "
    "env: {HF_HOME: /scratch/hf}, pass_env: [WANDB_API_KEY], "
    "container: {image: /images/rft.sif, binds: [/scratch]}, extra: {reservation: big}}",
    "launch.slurm.helper.partition=cpu",
    "stages.1.eval={evaluator: true, every: 50}",
    "launch.slurm.evaluator={partition: gpu, gpus_per_node: 1, time: '00:30:00'}",
]


def test_rendered_scripts_match_the_golden_files(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "scripts"
    sets = [a for s in GOLDEN_SETTINGS for a in ("--set", s)]
    result = rft({}, "render", DEMO, "--set", f"run.root={tmp_path}", "--set",
                 f"model.path={tiny_model}", *sets, "--name", "golden", "--out", out)
    assert result.returncode == 0, result.stderr
    rendered = sorted(p.name for p in out.iterdir())
    assert rendered == ["finalize.sbatch", "grpo.evaluator.sbatch", "grpo.explorer.sbatch",
                        "grpo.prepare.sbatch", "grpo.trainer.sbatch", "sft.trainer.sbatch",
                        "submit.sh"]
    for name in rendered:
        text = (out / name).read_text().replace(str(tmp_path), "<RUNS>").replace(
            str(ROOT), "<CWD>")
        if os.environ.get("RFT_UPDATE_GOLDEN") == "1":
            (GOLDEN / name).write_text(text)
        assert text == (GOLDEN / name).read_text(), f"{name} differs from tests/golden/{name}"
    # render lays out the run as submit does: the first stage is ready to run
    assert (tmp_path / "golden" / "stages" / "0-sft" / "config.yaml").exists()


def test_dry_run_prints_the_scripts_and_creates_and_submits_nothing(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    name = unique("dry")
    result = rft(slurm_env, "submit", DEMO, *short(tmp_path, tiny_model), "--name", name,
                 "--dry-run")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "#SBATCH --array=0-1" in out and "role explorer" in out and "role finalize" in out
    assert f"role trainer {tmp_path}/{name}/stages/1-grpo" in out
    assert "nothing was submitted" in out
    assert not (tmp_path / name).exists()
    assert jobs_in_queue(slurm_env, name) == []


@pytest.mark.parametrize(("setting", "named", "says"), [
    ("launch.slurm.explorer.partition=nope", "launch.slurm.explorer.partition", "nope"),
    ("launch.slurm.trainer.gpus_per_node=4", "launch.slurm.trainer.gpus_per_node", "gres"),
])
def test_resources_the_cluster_lacks_are_refused_before_submitting(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path, setting: str, named: str,
        says: str) -> None:
    name = unique("refused")
    result = rft(slurm_env, "submit", DEMO, *short(tmp_path, tiny_model, "--set", setting),
                 "--name", name)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert named in result.stderr and says in result.stderr
    assert "Nothing was submitted" in result.stderr
    assert not (tmp_path / name).exists()
    assert jobs_in_queue(slurm_env, name) == []


@pytest.mark.parametrize(("args", "env", "says"), [
    (["--set", "launch.slurm.trainer.env={HF_TOKEN: abc}"], {}, "list HF_TOKEN in pass_env"),
    (["--set", "launch.slurm.trainer.pass_env=[RFT_UNSET_TOKEN]"], {},
     "RFT_UNSET_TOKEN is not set in this environment"),
    (["--set", "run.root=/proc/rft-hpc-runs"], {}, "cannot create the run directory"),
    ([], {"PATH": "/nonexistent"}, "rft-hpc run CONFIG"),
    (["--set", "model.path=/nonexistent/model", "--set", "model.init=null"], {},
     "model folder '/nonexistent/model' does not exist"),
])
def test_bad_input_is_refused_with_a_clear_message(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path, args: list[str],
        env: dict[str, str], says: str) -> None:
    result = rft(slurm_env, "submit", DEMO, *short(tmp_path, tiny_model, *args), "--name",
                 unique("bad"), **env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert says in result.stderr


def test_submit_runs_the_demo_to_completion_like_a_local_run(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    name, token = unique("full"), secrets.token_hex(16)
    args = short(tmp_path, tiny_model, "--set", "launch.slurm.trainer.nodes=2",
                 "--set", "launch.slurm.trainer.pass_env=[RFT_TEST_TOKEN]",
                 "--set", """launch.slurm.trainer.setup=['echo "token of ${#RFT_TEST_TOKEN}"']""",
                 "--set", "launch.umask='0027'", "--set", "launch.group=daemon", *EVALUATOR)
    start = time.monotonic()
    result = rft(slurm_env, "submit", DEMO, *args, "--name", name, RFT_TEST_TOKEN=token)
    assert result.returncode == 0, result.stderr
    run = tmp_path / name
    watch = subprocess.Popen([sys.executable, "-m", "rft_hpc.cli", "status", str(run),
                              "--watch"], env=slurm_env, cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    final, seen = wait_for_run(slurm_env, run)
    print(f"submit to done: {time.monotonic() - start:.1f} s")
    assert final["state"] == "done", final
    out, err = watch.communicate(timeout=60)  # --watch ends by itself when the run does
    assert watch.returncode == 0 and ": done" in out and "restarts" in out, err
    assert [j["name"] for j in seen[0]["jobs"]] == [
        "sft.trainer", "grpo.prepare", "grpo.explorer", "grpo.trainer", "grpo.evaluator",
        "finalize"]
    assert any(j["state"] == "RUNNING" for info in seen for j in info["jobs"])
    assert all(j["state"] == "COMPLETED" for j in final["jobs"])
    assert set(final["jobs"][2]["tasks"]) == {f"{final['jobs'][2]['id']}_{i}" for i in (0, 1)}
    trainer = final["jobs"][3]["id"]  # 2 ranks over both nodes, met through a file store
    step = slurm(["sacct", "--noheader", "--parsable2", "--format=NTasks,NodeList",
                  f"--jobs={trainer}.0"], slurm_env)
    assert step.split() == ["2|n[1-2]"]
    trainer_log = (run / "stages" / "1-grpo" / "jobs" / "trainer.log").read_text()
    assert f"2 ranks over gloo, met through file://{run}/stages/1-grpo/state/dist-{trainer}" \
        in trainer_log, trainer_log[-2000:]
    beats = {(r["stage"], r["role"]): r for r in final["roles"]}
    assert beats[("1-grpo", "trainer")]["step"] == 6 and beats[("1-grpo", "trainer")][
        "version"] == 6
    assert {beats[("1-grpo", f"explorer-{i}")]["status"] for i in (0, 1)} == {"done"}

    # the same figures as `rft-hpc run` writes (tests/integration/test_experiment_run.py)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary["trainer"]["steps"] == 8 + 6 and summary["explorer"]["steps"] == 2 * 6
    assert set(summary["seconds"]) == {"sft", "grpo", "launcher_wall"}
    assert all(s["seconds"] > 0 for s in summary["stages"])
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert jobs_in_queue(slurm_env, name) == []
    assert set(final["jobs"][4]["tasks"]) == {f"{final['jobs'][4]['id']}_{i}" for i in (0, 1, 2)}
    assert scores_match_trainer(summary, run / "stages" / "1-grpo", [0, 3, 6])

    logs = rft(slurm_env, "logs", run, "trainer")
    assert logs.returncode == 0 and logs.stdout.count("exit status 0") == 2
    assert f"token of {len(token)}" in logs.stdout  # the secret reached the job by name ...
    for path in run.rglob("*"):  # ... and was written nowhere
        assert path.is_dir() or token.encode() not in path.read_bytes(), path

    # shared with the group, files of the jobs with the umask
    daemon = grp.getgrnam("daemon").gr_gid
    assert run.stat().st_gid == daemon and run.stat().st_mode & stat.S_ISGID
    log = run / "stages" / "1-grpo" / "jobs" / "trainer.log"
    assert log.stat().st_gid == daemon and log.stat().st_mode & 0o027 == 0
    for shared in (run / "stages" / "1-grpo" / "state" / "trainer.json", run / "summary.json",
                   run / "stages" / "1-grpo" / "weights" / "v000006" / "model.safetensors"):
        assert shared.stat().st_mode & 0o777 == 0o640, shared  # group may read, not write
    assert beats[("1-grpo", "trainer")]["restarts"] == 0

    again = rft(slurm_env, "submit", DEMO, *args, "--name", name, RFT_TEST_TOKEN=token)
    assert again.returncode == 0 and "nothing to submit" in again.stdout, again.stderr
    other = rft(slurm_env, "submit", DEMO, *args, "--set", "sync.offset=0", "--name", name,
                RFT_TEST_TOKEN=token)
    assert other.returncode == 2 and "different config" in other.stderr


def test_cancel_leaves_nothing_of_the_run_in_squeue(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    name = unique("cancel")
    result = rft(slurm_env, "submit", DEMO, *short(tmp_path, tiny_model, "--set", "stages=[]",
                                                   "--set", "trainer.steps=100000"),
                 "--name", name)
    assert result.returncode == 0, result.stderr
    run = tmp_path / name
    deadline = time.monotonic() + 60
    while not any(j["state"] == "RUNNING" for j in status(slurm_env, run)["jobs"]):
        assert time.monotonic() < deadline, "no job of the run started"
        time.sleep(0.5)
    assert len(jobs_in_queue(slurm_env, name)) == 4  # two explorers, trainer, finalize

    cancelled = rft(slurm_env, "cancel", run)
    assert cancelled.returncode == 0, cancelled.stderr
    assert jobs_in_queue(slurm_env, name) == []
    final, _ = wait_for_run(slurm_env, run, timeout=30)
    assert final["state"] == "cancelled", final


def test_a_rendered_script_runs_its_role_under_plain_sbatch(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    out, name = tmp_path / "scripts", unique("render")
    result = rft(slurm_env, "render", DEMO, *short(tmp_path, tiny_model, "--set", "stages=[]",
                                                   "--set", "mode=explore",
                                                   "--set", "explorer.steps=1"),
                 "--name", name, "--out", out)
    assert result.returncode == 0, result.stderr
    submitted = slurm(["bash", str(out / "submit.sh")], slurm_env)
    ids = dict(line.split(": ") for line in submitted.splitlines())
    assert list(ids) == ["main.explorer", "finalize"]
    states = wait_for_states(ids["finalize"], slurm_env, timeout=120)
    stage = tmp_path / name / "stages" / "0-main"
    assert states == {ids["finalize"]: "COMPLETED"}, rft(slurm_env, "logs", stage.parent.parent)
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["explorer"]["steps"] == 2 * 1 and summary["trainer"]["steps"] == 0
    assert sorted(p.name for p in (stage / "buffer").iterdir() if p.is_dir()) == [
        "explorer-0", "explorer-1"]
