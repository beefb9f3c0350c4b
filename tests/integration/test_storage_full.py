"""A disk that fills up (ENOSPC) or a quota that runs out (EDQUOT) in the middle of a real
run: every role's writes go through the fault filesystem (tests/helpers/faultfs), whose
fault, once struck, fails every later write of every process until it is lifted. The run
stops with one message naming the error and the path, without a traceback; the same command
run again once space is back finishes it, and every record in the buffer (counted with
plain h5py) is trained on exactly once, as `rft-hpc audit` checks."""

from __future__ import annotations

import errno
import json

import pytest
from helpers.fault_runs import assert_nothing_lost, demo_on, h5py_rows
from helpers.faultfs import FaultMount
from helpers.paths import DEMO
from helpers.ranks import finish, sft_stage, start_ranks, trainer_command
from helpers.reward_models import reward_model
from helpers.reward_runs import reward_run_config
from helpers.runs import rft, short

pytestmark = [pytest.mark.needs_program("fusermount3"), pytest.mark.needs_module("mfusepy")]

OPS = {"ENOSPC": ["write", "fsync"], "EDQUOT": ["write", "fsync", "create", "mkdir"]}
"""The calls each error strikes: a full disk fails writes, an exceeded quota creates too."""
SEED, RATE = 5, 0.002
"""The fault's generator first strikes the 574th matching call of the run's ~1300 (every
process's calls in one sequence): about halfway, whichever process makes it."""
RECORDS = 2 * 6 * 2 * 8  # explorers x steps x tasks x repeat


@pytest.mark.timeout(600)
@pytest.mark.parametrize("code", ["ENOSPC", pytest.param("EDQUOT", marks=pytest.mark.long)])
def test_a_full_disk_stops_the_run_with_one_message_and_the_same_command_finishes_it(
        tmp_path, tiny_model, code):
    fault = {"ops": OPS[code], "errno": code, "rate": RATE, "sticky": True}
    with FaultMount(tmp_path / "fs", {"seed": SEED, "faults": [fault]}) as fs:
        run_dir = fs.path / "demo"
        stage = run_dir / "stages" / "0-main"
        first = demo_on(fs, tiny_model)
        said = first.stdout + first.stderr
        assert first.returncode == getattr(errno, code), said[-3000:]
        assert "Traceback" not in said, said[-3000:]
        errors = [line for line in said.splitlines() if "error" in line.lower()]
        assert len(errors) == 1, errors
        assert errors[0].startswith("error: ") and " stopped: " in errors[0], errors
        assert f"({code}) writing {run_dir}/" in errors[0], errors
        assert "then run the same command again; nothing committed is lost" in errors[0]
        hits = fs.fired()
        assert hits and {h["errno"] for h in hits} == {code}, hits
        assert 0 < h5py_rows(stage / "buffer") < RECORDS  # struck in the middle of the run

        fs.update(faults=[])  # space is back
        again = demo_on(fs, tiny_model)  # the same command
        assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
        assert "Traceback" not in again.stdout + again.stderr

        assert not [p for p in stage.rglob(".tmp-*")]  # nothing half-written is left
    assert assert_nothing_lost(fs)["in_buffer"] == RECORDS


def test_a_run_that_starts_on_a_full_disk_says_so_at_once(tmp_path, tiny_model):
    fault = {"ops": OPS["ENOSPC"], "errno": "ENOSPC", "rate": 1.0, "sticky": True}
    with FaultMount(tmp_path / "fs", {"seed": 0, "faults": [fault]}) as fs:
        result = rft("run", DEMO, *short(fs.path, tiny_model), timeout=300)
    said = result.stdout + result.stderr
    assert result.returncode == errno.ENOSPC, said[-3000:]
    assert "Traceback" not in said
    lines = said.strip().splitlines()
    assert len(lines) == 1, said
    assert lines[0].startswith("error: rft-hpc stopped: No space left on device (ENOSPC) "
                               f"writing {fs.path}/demo"), lines
    assert lines[0].endswith("free space or raise the quota, then run the same command "
                             "again; nothing committed is lost"), lines


@pytest.mark.timeout(300)
def test_a_full_disk_at_rank_0s_checkpoint_stops_every_trainer_rank(tmp_path, tiny_model):
    fault = {"ops": OPS["EDQUOT"], "errno": "EDQUOT", "rate": 1.0, "sticky": True,
             "path": "/ckpt/"}  # the checkpoints alone: rank 0's first save fails
    with FaultMount(tmp_path / "fs", {"seed": 0, "faults": [fault]}) as fs:
        stage = sft_stage(fs.path, tiny_model, "full", steps=4, save_interval=2, batch_size=4)
        procs = start_ranks(trainer_command(stage), 2, tmp_path / "dist-1")
        # the other rank is told to stop, not left waiting for the collective timeout
        results = finish(procs, timeout=120)
        assert fs.fired()
        assert not (stage / "ckpt" / "LATEST").exists()
    assert [rc for rc, _ in results] == [errno.EDQUOT, 0], [e[-3000:] for _, e in results]
    errors = [line for _, err in results for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: trainer stopped: Disk quota exceeded (EDQUOT) writing {stage}/ckpt/"), errors
    assert not any("Traceback" in err for _, err in results)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_reward_job_on_a_full_disk_stops_the_run_and_its_next_process_answers(
        tmp_path, tiny_model):
    fault = {"ops": OPS["ENOSPC"], "errno": "ENOSPC", "rate": 1.0, "sticky": True,
             "path": "/reward/", "process": "reward"}  # its first response cannot be written
    rm = reward_model(tmp_path / "rm")
    with FaultMount(tmp_path / "fs", {"seed": 0, "faults": [fault]}) as fs:
        config = reward_run_config(fs.path, "rj", tiny_model,
                                   [f"{{model: {rm}, weight: 1.0, batch_size: 6}}"],
                                   extra="reward_job: {count: 1}\n")
        first = rft("run", config, timeout=300)
        said = first.stdout + first.stderr
        assert first.returncode == errno.ENOSPC, said[-3000:]
        errors = [line for line in said.splitlines() if "error" in line.lower()]
        stage = fs.path / "runs" / "rj" / "stages" / "0-main"
        assert len(errors) == 1 and errors[0].startswith(
            "error: reward-0 stopped: No space left on device (ENOSPC) writing "
            f"{stage}/reward/job-0/"), errors
        assert "Traceback" not in said
        fs.update(faults=[])
        again = rft("run", config, timeout=300)
        assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
        report = rft("audit", fs.path / "runs" / "rj", "--json", timeout=300)
        assert report.returncode == 0, report.stdout[-3000:]
        records = json.loads(report.stdout)["stages"][0]["records"]
        assert records["consumed"] == records["in_buffer"] == h5py_rows(stage / "buffer") == 16
