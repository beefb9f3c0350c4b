"""`rft-hpc run` end to end: real role processes, real buffer, real training."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.paths import DEMO, ROOT
from helpers.runs import EVALUATOR, rft, rollouts, scores_match_trainer, short

from rft_hpc.monitor.metrics import read_metrics


@pytest.mark.timeout(600)  # three runs, an evaluator: ~160 s loaded
def test_a_short_on_policy_run_writes_summary_metrics_and_report(tmp_path, tiny_model):
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "sync.offset=0",
                                     *EVALUATOR), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "demo"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer"]["steps"] == 8 + 6
    assert summary["explorer"]["steps"] == 2 * 6
    for key in ("initial_accuracy", "final_accuracy", "base_accuracy"):
        assert 0.0 <= summary["eval"][key] <= 1.0
    assert set(summary["seconds"]) >= {"sft", "grpo"}
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    grpo = run / "stages" / "1-grpo"
    records = rollouts(grpo)
    assert len(records) == 2 * 6 * 2 * 8
    # sync.offset 0: explorer step s samples with exactly the weights of trainer step s
    assert all(r.policy_version == r.step for r in records)
    trained = [r for r in read_metrics(grpo / "metrics" / "trainer.jsonl") if "loss" in r]
    assert [r["step"] for r in trained] == list(range(1, 7))
    evals = [r["step"] for r in read_metrics(grpo / "metrics" / "trainer.jsonl")
             if r.get("eval_accuracy") is not None]
    assert evals == [0, 3, 6]
    assert list((grpo / "metrics" / "tb" / "trainer").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (grpo / "weights").iterdir())[-1] == "v000006"
    # the evaluator scored versions 0, 3 and 6 (v3 kept from pruning for it) exactly as the
    # trainer's own greedy evaluation of the same weights did
    assert (grpo / "weights" / "v000003").is_dir()
    assert scores_match_trainer(summary, grpo, [0, 3, 6])

    again = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "sync.offset=0",
                                    *EVALUATOR), timeout=120)
    assert again.returncode == 0 and "held-out accuracy" in again.stdout  # finished: no-op
    other = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "sync.offset=1"))
    assert other.returncode != 0 and "different config" in other.stderr


def test_async_offset_bounds_the_policy_lag(tmp_path, tiny_model):
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "sync.offset=2",
                                     "--set", "stages=[]"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = rollouts(tmp_path / "demo" / "stages" / "0-main")
    # An explorer may lag the newest weights by at most sync.offset steps. (It can also be
    # ahead: when the other explorer is slower, the trainer's FIFO batches run ahead on this
    # one's data, so it samples with weights newer than its step: fresher, never staler.)
    lags = {r.step - r.policy_version for r in records}
    assert lags and max(lags) <= 2


def test_explore_mode_runs_explorers_only(tmp_path, tiny_model):
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "stages=[]",
                                     "--set", "mode=explore", "--set", "explorer.steps=3"),
                 timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "demo" / "stages" / "0-main"
    records = rollouts(stage)
    assert len(records) == 2 * 3 * 2 * 8 and {r.policy_version for r in records} == {0}
    assert not (stage / "metrics" / "trainer.jsonl").exists()


def _wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(600)  # two stages, run twice
def test_interrupt_stops_every_role_and_the_same_command_resumes(tmp_path, tiny_model):
    # 16 GRPO steps: the interrupt comes at step 5, the resumed run trains the rest
    args = ["run", DEMO, *short(tmp_path, tiny_model, "--set", "trainer.steps=16",
                                "--set", "trainer.save_interval=100")]
    proc = subprocess.Popen([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    grpo = tmp_path / "demo" / "stages" / "1-grpo"
    heartbeat = grpo / "state" / "trainer.json"

    def trained_some():
        try:
            return json.loads(heartbeat.read_text())["step"] >= 5
        except (OSError, ValueError, KeyError):
            return False

    assert _wait_for(trained_some, 300), "the GRPO trainer never reached step 5"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "run the same command again to resume" in err
    assert "Traceback" not in err
    stopped = json.loads(heartbeat.read_text())
    assert stopped["status"] == "stopped" and 5 <= stopped["step"] < 16
    for state in (grpo / "state").glob("*.json"):
        pid = json.loads(state.read_text()).get("pid")
        if pid:
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"{state.name} still runs"

    resumed = rft(*args, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    trained = [r["step"] for r in read_metrics(grpo / "metrics" / "trainer.jsonl") if "loss" in r]
    assert trained == list(range(1, 17)), "a trainer step was lost or done twice"
    for i in range(2):
        steps = [r["step"] for r in read_metrics(grpo / "metrics" / f"explorer-{i}.jsonl")]
        assert sorted(set(steps)) == list(range(16))
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["trainer"]["steps"] == 8 + 16


def _zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def offline_sft_run(tmp_path, tiny_model, operands, *extra):
    """A one-stage offline SFT run of the demo on samples `a+a=` -> `2a` for `operands`,
    from a JSONL file; its stage folder."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "response": str(2 * a)}) + "\n"
                            for a in operands))
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "stages=[]",
                                     "--set", "mode=train", "--set", "algorithm.algorithm_type=sft",
                                     "--set", f"data={{source: jsonl, path: {data}, kind: sft}}",
                                     *extra), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "demo" / "stages" / "0-main"


def test_offline_sft_from_a_jsonl_file(tmp_path, tiny_model):
    stage = offline_sft_run(tmp_path, tiny_model, range(10, 60), "--set", "trainer.batch_size=16",
                            "--set", "trainer.lr=1e-3", "--set", "buffer.max_uses=3")
    losses = [r["loss"] for r in read_metrics(stage / "metrics" / "trainer.jsonl") if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (stage / "buffer" / "import-data" / "00000000.h5").exists()
    assert not (stage / "metrics" / "explorer-0.jsonl").exists()


INTERRUPTED_STEPS = 20


def interrupted_args(root: Path, model: Path, name: str, colocate: str) -> list[str]:
    """The deterministic run of the interrupted-run test: strictly on-policy, one explorer,
    batches of exactly one explorer step."""
    return ["run", DEMO, *short(root, model, "--set", "stages=[]",
                                "--set", f"run.name={name}", "--set", "explorer.count=1",
                                "--set", "sync.offset=0", "--set", "trainer.batch_size=16",
                                "--set", f"trainer.steps={INTERRUPTED_STEPS}",
                                "--set", "eval.interval=0", "--set", "trainer.save_interval=100",
                                "--set", f"launch.colocate={colocate}",
                                *(("--set", "buffer.compact={min_segments: 2, fanout: 2}")
                                  if name == "twice" else ()))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model):
    """The final weights of the interrupted-run test's config run without interruption,
    split into two processes."""
    from rft_hpc.sync.weight_files import load_weights

    root = tmp_path_factory.mktemp("straight")
    straight = rft(*interrupted_args(root, tiny_model, "straight", "false"), timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    return load_weights(root / "straight" / "stages" / "0-main" / "weights", INTERRUPTED_STEPS)


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_a_run_interrupted_twice_ends_with_the_weights_of_an_uninterrupted_one(
        tmp_path, tiny_model, uninterrupted, placement):
    """The interrupted run also folds what each checkpoint consumed into archives (every 2
    segments), and its resumes read on from them. The uninterrupted run is split into two
    processes: a colocated run interrupted twice ends with its weights too (the placement
    changes nothing but where the loops run)."""
    stage = tmp_path / "twice" / "stages" / "0-main"
    twice = interrupted_args(tmp_path, tiny_model, "twice",
                             "true" if placement == "colocated" else "false")
    for stop_at in (2, 5):  # early: the run must still be going when the signal lands
        proc = subprocess.Popen([sys.executable, "-m", "rft_hpc.cli", *map(str, twice)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

        def reached(step=stop_at):  # in this process: the last one's heartbeat says stopped
            try:
                beat = json.loads((stage / "state" / "trainer.json").read_text())
                return beat["status"] == "running" and beat["step"] >= step
            except (OSError, ValueError, KeyError):
                return False

        assert _wait_for(reached, 300), f"the trainer never reached step {stop_at}"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "run the same command again" in err, err[-2000:]
    resumed = rft(*twice, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logs = {p.name for p in (stage / "jobs").glob("*.log")}
    assert ("colocated.log" in logs) == (placement == "colocated"), logs

    from rft_hpc.sync.weight_files import load_weights

    two = load_weights(stage / "weights", INTERRUPTED_STEPS)
    diff = max(float((uninterrupted[k] - two[k]).abs().max()) for k in uninterrupted)
    print(f"final weights, uninterrupted split vs interrupted twice {placement}: "
          f"max |diff| {diff:.3g}")
    assert diff <= 1e-6
    assert list((stage / "buffer").glob("*/archive-*.h5")), "nothing was compacted"
    report = rft("audit", tmp_path / "twice", "--json")
    assert report.returncode == 0, report.stdout[-3000:]
    assert json.loads(report.stdout)["stages"][0]["trainer"]["restarts"] == 2


def test_an_sft_stage_whose_data_runs_out_ends_short_with_a_warning(tmp_path, tiny_model):
    # 20 samples, each used once: 2 batches of 10 for 5 steps
    stage = offline_sft_run(tmp_path, tiny_model, range(10, 30), "--set", "trainer.batch_size=10",
                            "--set", "trainer.steps=5", "--set", "buffer.max_uses=1")
    trained = [r["step"] for r in read_metrics(stage / "metrics" / "trainer.jsonl") if "loss" in r]
    assert trained == [1, 2]
    log = (stage / "jobs" / "trainer.log").read_text()
    assert "WARNING trainer" in log and "no more data will come after step 2 of 5" in log
    assert "the stage ends 3 steps short" in log
