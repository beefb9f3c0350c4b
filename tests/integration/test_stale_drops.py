"""Records the trainer drops as stale (`buffer.max_staleness`, `stale: drop`) are replaced:
explorers whose steps are derived from the trainer's write more steps, so the trainer still
trains `trainer.steps` full batches and the run does not end short (a seed-2 run of the
off-policy learning test ended one step short before: 64 records dropped, none replaced)."""

from __future__ import annotations

from helpers.paths import DEMO
from helpers.runs import rft, rollouts, short

from rft_hpc.core.rundir import read_json
from rft_hpc.monitor.metrics import read_metrics


def test_stale_records_dropped_by_the_trainer_are_replaced_and_the_run_finishes(
        tmp_path, tiny_model):
    # one explorer 3 versions ahead, nothing older than the trainer's own version accepted:
    # the steps it samples ahead with old weights are dropped
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "stages=[]",
                                     "--set", "explorer.count=1", "--set", "sync.offset=3",
                                     "--set", "buffer.max_staleness=0"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "demo"
    stage = run / "stages" / "0-main"
    trained = [m for m in read_metrics(stage / "metrics" / "trainer.jsonl") if "loss" in m]
    dropped = sum(m["stale_dropped"] for m in trained)
    assert len(trained) == 6 and dropped > 0, (len(trained), dropped)
    assert all(m["staleness/max"] == 0 for m in trained)
    quota = 6 * 32 // (2 * 8)  # trainer steps x batch / records per explorer step
    explorer = read_json(stage / "state" / "explorer-0.json")
    assert explorer["status"] == "done" and explorer["step"] > quota, explorer
    assert len(rollouts(stage)) == explorer["step"] * 2 * 8
    assert "ends" not in (stage / "jobs" / "trainer.log").read_text()  # not short
    audit = rft("audit", run)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-2000:]
