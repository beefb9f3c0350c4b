"""Operating a local run: role logs with one line per step, `--log-level`, and `status` of
a run while it runs and after it ends (real role processes, real files)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
STEPS = 6


def small(tmp_path, model, *extra):
    """The demo shrunk to one stage, one explorer and a few fast steps."""
    return ["--set", f"run.root={tmp_path}", "--set", f"model.path={model}",
            "--set", "stages=[]", "--set", "tasks.eval_size=16", "--set", "eval.interval=0",
            "--set", "explorer.count=1", "--set", "explorer.tasks_per_step=2",
            "--set", "trainer.batch_size=16", "--set", f"trainer.steps={STEPS}", *extra]


def rft(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def start(*args):
    return subprocess.Popen([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def read(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def step_lines(log, role):
    """The step numbers of the one-line-per-step records in a role's log."""
    pattern = re.compile(rf" INFO {role}: step (\d+)/{STEPS} version \S+ reward \S+ [\d.]+ s")
    return [int(m.group(1)) for m in map(pattern.search, log.read_text().splitlines()) if m]


def test_a_local_run_logs_each_step_and_status_shows_its_roles(tmp_path, tiny_model):
    # sync.offset 0: the explorer needs the trainer's newest weights for every step, so a
    # trainer held with SIGSTOP holds the whole run in "running" while status looks at it
    proc = start("run", DEMO, *small(tmp_path, tiny_model, "--set", "sync.offset=0"))
    run, stage = tmp_path / "demo", tmp_path / "demo" / "stages" / "0-main"
    try:
        wait_until(lambda: read(stage / "state" / "trainer.json").get("step", 0) >= 2, 300,
                   "trainer step 2")
        trainer_pid = read(run / "state" / "processes.json")["roles"]["0-main/trainer"]["pid"]
        os.kill(trainer_pid, signal.SIGSTOP)
        try:
            shown = rft("status", run)
            info = json.loads(rft("status", run, "--json").stdout)
        finally:
            os.kill(trainer_pid, signal.SIGCONT)
        assert shown.returncode == 0, shown.stderr
        assert "(local on " in shown.stdout and ": running" in shown.stdout
        assert info["state"] == "running" and info["local"] and info["jobs"] == []
        roles = {r["role"]: r for r in info["roles"]}
        assert set(roles) == {"trainer", "explorer-0"}
        for name, role in roles.items():
            assert role["state"] == "running" and role["total"] == STEPS, role
            assert 1 <= role["step"] < STEPS and role["version"] is not None, role
            assert re.search(rf"{name} +│ running +│ +{role['step']}/{STEPS} ", shown.stdout)
        assert roles["trainer"]["pid"] == trainer_pid

        watched = rft("status", run, "--watch", timeout=300)  # returns when the run ends
        assert watched.returncode == 0, watched.stderr
        assert ": done" in watched.stdout
        assert len(re.findall(rf"│ finished +│ +{STEPS}/{STEPS} ", watched.stdout)) == 2
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    after = json.loads(rft("status", run, "--json").stdout)
    assert after["state"] == "done" and after["summary"]
    for role in after["roles"]:
        assert role["state"] == "finished" and role["step"] == role["total"] == STEPS, role
        assert role["eta"] == 0.0 and role["rate"] > 0
    assert {r["role"]: r["version"] for r in after["roles"]}["trainer"] == STEPS
    shown = rft("status", run)
    assert "finished" in shown.stdout and "running" not in shown.stdout

    # one line per step in each role's log, as many as the steps it did
    summary = json.loads((run / "summary.json").read_text())
    assert step_lines(stage / "jobs" / "trainer.log", "trainer") == list(range(1, STEPS + 1))
    assert summary["trainer"]["steps"] == STEPS
    assert step_lines(stage / "jobs" / "explorer-0.log", "explorer-0") == list(
        range(1, summary["explorer"]["steps"] + 1))
    assert " DEBUG " not in (stage / "jobs" / "trainer.log").read_text()


def test_log_level_changes_what_the_role_logs_hold(tmp_path, tiny_model):
    explore = ("--set", "mode=explore", "--set", "explorer.steps=2")
    procs = {level: start("--log-level", level, "run", DEMO,
                          *small(tmp_path, tiny_model, *explore, "--set", f"run.name={level}"))
             for level in ("debug", "WARNING")}
    for level, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{level}: {err[-3000:]}"
    debug = (tmp_path / "debug" / "stages" / "0-main" / "jobs" / "explorer-0.log").read_text()
    assert re.search(r" DEBUG explorer-0: step 1: \{.*'reward_mean'", debug)
    assert len(re.findall(r" INFO explorer-0: step \d/2 ", debug)) == 2
    quiet = (tmp_path / "WARNING" / "stages" / "0-main" / "jobs" / "explorer-0.log").read_text()
    assert " INFO " not in quiet and " DEBUG " not in quiet

    bad = rft("--log-level", "loud", "status", tmp_path / "debug")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "unknown log level 'loud': use one of DEBUG, INFO, WARNING, ERROR" in bad.stderr


def test_warnings_and_errors_name_the_step_the_role_is_on():
    code = ("import logging\n"
            "from rft_hpc.runtime.logs import at_step, setup_logging\n"
            "setup_logging('explorer-3')\n"
            "log = logging.getLogger('rft_hpc.explorer.role')\n"
            "log.info('before'); at_step(7); log.info('during'); log.warning('slow weights')\n"
            "log.error('broken'); at_step(None); log.warning('after')\n"
            "logging.getLogger('other.library').info('not shown at INFO')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "RFT_LOG_LEVEL": "INFO"})
    lines = [line.split(" ", 2)[2] for line in out.stderr.splitlines()]
    assert lines == ["INFO explorer-3: before", "INFO explorer-3: during",
                     "WARNING explorer-3 [step 7]: slow weights",
                     "ERROR explorer-3 [step 7]: broken", "WARNING explorer-3: after"]


def test_log_level_reaches_the_sbatch_scripts(tmp_path, tiny_model):
    out = tmp_path / "scripts"
    result = rft("--log-level", "DEBUG", "render", DEMO, "--out", out,
                 "--set", f"run.root={tmp_path}", "--set", f"model.path={tiny_model}",
                 timeout=300)
    assert result.returncode == 0, result.stderr
    scripts = list(out.glob("*.sbatch"))
    assert scripts and all("export RFT_LOG_LEVEL=DEBUG\n" in s.read_text() for s in scripts)
