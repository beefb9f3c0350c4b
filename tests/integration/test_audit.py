"""`rft-hpc audit` on small real runs: real segments, ledgers written as docs/ledger.md says."""

import json
import subprocess
import sys

import pytest

from rft_hpc.buffer import Experience, RecordRef, SegmentWriter
from rft_hpc.buffer.archive import list_writer
from rft_hpc.buffer.compact import compact_buffer
from rft_hpc.buffer.layout import quarantine_segment
from rft_hpc.config import ExperimentConfig
from rft_hpc.config.buffer import CompactConfig
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import atomic_write_json
from rft_hpc.ledger.audit import audit_run
from rft_hpc.ledger.log import LedgerWriter, compact_refs
from rft_hpc.runtime.common import freeze_config

EXPLORERS, STEPS, PER_STEP = 2, 5, 2  # explorer steps 0..4, trainer steps 1..5 of 4 records


def rft(*args):
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def make_stage(root):
    """A run with one stage: explorers wrote steps 0..4 (the records of step s were sampled
    with version s); no trainer yet. Returns the stage directory."""
    config = ExperimentConfig.model_validate({
        "trainer": {"steps": STEPS, "batch_size": EXPLORERS * PER_STEP},
        "explorer": {"count": EXPLORERS, "tasks_per_step": 1, "repeat": PER_STEP}})
    freeze_config(config, root / "config.yaml")
    stage = root / "stages" / "0-main"
    freeze_config(config, stage / "config.yaml")
    for e in range(EXPLORERS):
        ledger = LedgerWriter(stage / "ledger", f"explorer-{e}")
        ledger.start(0, first_redone=0)
        writer = SegmentWriter(stage / "buffer", f"explorer-{e}", "rl")
        for step in range(STEPS):
            writer.write_step(step, [
                Experience([1, 2, 3, 4], 2, reward=1.0, group_id=step, policy_version=step,
                           step=step) for _ in range(PER_STEP)])
            ledger.append("step", step=step, records=PER_STEP, version=step, seconds=1.0)
        ledger.append("stop", step=STEPS, reason="done")
        ledger.close()
    return stage


def batch(step):
    """The records FIFO hands to trainer step `step`: explorer step step-1 of each writer."""
    return [RecordRef(f"explorer-{e}", step - 1, i)
            for e in range(EXPLORERS) for i in range(PER_STEP)]


def step_event(ledger, step, t, *, refs=None, published=True):
    refs = batch(step) if refs is None else refs
    ledger.append("step", time=t, step=step, consumed=compact_refs(refs),
                  published=step if published is True else published, dropped_stale=0,
                  seconds=2.0)


def start_event(ledger, t, resume_step):
    ledger.append("start", time=t, resume_step=resume_step, first_redone=resume_step + 1, pid=1,
                  slurm_restarts=0, job=None)


def finish(stage, ledger, t, steps=STEPS):
    ledger.append("stop", time=t, step=steps, reason="done")
    ledger.close()
    atomic_write_json(stage / "state" / "trainer.json", {"role": "trainer", "status": "done",
                                                         "step": steps})


def write_trainer(stage, steps=range(1, STEPS + 1), **changes):
    """A trainer ledger without a restart: steps 1..5 at times 10, 20, ...; `changes` maps
    `step_<k>` to keyword arguments of that step's event."""
    ledger = LedgerWriter(stage / "ledger", "trainer")
    start_event(ledger, 0.0, 0)
    for k in steps:
        step_event(ledger, k, 10.0 * k, **changes.get(f"step_{k}", {}))
        ledger.append("save", time=10.0 * k + 1, step=k)
    finish(stage, ledger, 100.0)


def problems(report):
    return [p for s in report.stages for c in s.checks for p in c.problems]


@pytest.fixture
def stage(tmp_path):
    return make_stage(tmp_path / "run")


def test_clean_history_passes(stage):
    write_trainer(stage)
    report = audit_run(stage.parents[1])
    assert report.ok, problems(report)
    [audit] = report.stages
    assert audit.trainer["steps"] == STEPS and audit.trainer["restarts"] == 0
    assert audit.trainer["finished"] is True
    assert audit.records == {"in_buffer": 20, "consumed": 20, "unconsumed": 0, "lost": 0,
                             "needed": 20}
    assert audit.explorers["explorer-1"] == {"steps": STEPS, "restarts": 0, "redone_steps": 0,
                                             "seconds_lost": [], "causes": []}
    assert {c.name: c.result for c in audit.checks}["explorer segments"] == "PASS"
    assert audit_run(stage).ok  # a single stage directory is accepted too


def test_restart_voids_the_redone_steps_and_counts_the_seconds_lost(stage):
    ledger = LedgerWriter(stage / "ledger", "trainer")
    start_event(ledger, 0.0, 0)
    for k in range(1, 6):
        step_event(ledger, k, 10.0 * k)
        if k == 3:
            ledger.append("save", time=31.0, step=3)
    # killed after step 5; the next process restores the checkpoint of step 3 at t=60
    start_event(ledger, 60.0, 3)
    for k in (4, 5):
        step_event(ledger, k, 60.0 + 10 * k)
    finish(stage, ledger, 200.0)
    report = audit_run(stage.parents[1])
    assert report.ok, problems(report)
    trainer = report.stages[0].trainer
    assert trainer["restarts"] == 1 and trainer["redone_steps"] == 2
    assert trainer["steps"] == 5 and trainer["causes"] == ["crash"]
    assert trainer["seconds_lost"] == [10.0 + 2 * 2.0]  # the gap 50 -> 60 plus steps 4 and 5


def test_a_record_consumed_twice_fails_naming_it(stage):
    write_trainer(stage, step_2={"refs": [*batch(2), RecordRef("explorer-0", 0, 1)]})
    report = audit_run(stage.parents[1])
    assert not report.ok
    assert problems(report) == [
        "explorer-0/0/1 consumed 2 times (max_uses 1): steps 1, 2"]


def test_a_step_missing_fails(stage):
    write_trainer(stage, steps=[1, 2, 4, 5])
    found = problems(audit_run(stage.parents[1]))
    assert "trainer step 3 missing" in found
    # fifo: step 3's records were passed over while later ones were consumed
    assert "buffer/explorer-0/00000002.h5 records 0, 1 skipped: later records of explorer-0 " \
        "were consumed (fifo)" in found
    assert len(found) == 3


def test_a_step_done_twice_without_a_restart_fails(stage):
    ledger = LedgerWriter(stage / "ledger", "trainer")
    start_event(ledger, 0.0, 0)
    for n, k in enumerate((1, 2, 3, 3, 4, 5)):
        step_event(ledger, k, 10.0 * n, **({"refs": [], "published": None} if n == 3 else {}))
    finish(stage, ledger, 100.0)
    assert problems(audit_run(stage.parents[1])) == ["trainer step 3 done 2 times (lines 5, 6)"]


def test_a_consumed_record_absent_from_the_buffer_fails(stage):
    extra = [RecordRef("explorer-0", 9, 0), RecordRef("explorer-1", 0, 7)]
    write_trainer(stage, step_5={"refs": [*batch(5), *extra]})
    found = problems(audit_run(stage.parents[1]))
    assert len(found) == 2
    assert "explorer-1/0/7 consumed at step 5 does not exist: the segment holds 2 records" \
        in found
    assert any(p.startswith("1 consumed records (explorer-0/9/0) at steps 5 are not in the "
                            "buffer: no segment buffer/explorer-0/00000009.h5") for p in found)


def test_records_of_a_quarantined_segment_are_lost_not_failed(stage):
    write_trainer(stage)
    quarantine_segment(stage / "buffer", stage / "buffer" / "explorer-1" / "00000002.h5",
                       "test: flipped bytes")
    report = audit_run(stage.parents[1])
    [audit] = report.stages
    assert audit.records["lost"] == 2 and audit.records["in_buffer"] == 18
    detail = {c.name: c.detail for c in audit.checks}["consumed records exist"]
    assert "2 lost to quarantined or unreadable segments" in detail
    # the explorer ledger's step 2 is not in a committed segment any more: reported only
    assert report.ok, problems(report)


def test_a_published_version_that_does_not_increase_fails(stage):
    write_trainer(stage, step_3={"published": 2}, step_4={"published": None})
    assert problems(audit_run(stage.parents[1])) == [
        "version 2 published at step 3 after version 2 at step 2"]


def test_explorer_versions_must_match_the_buffer_and_never_go_back(stage):
    write_trainer(stage)
    ledger = LedgerWriter(stage / "ledger", "explorer-0")
    ledger.append("start", time=500.0, resume_step=4, first_redone=4, pid=2, slurm_restarts=0,
                  job=None)  # redoes step 4 (as if its segment had been lost)
    ledger.append("step", step=4, records=PER_STEP, version=3, seconds=1.0)
    ledger.close()
    report = audit_run(stage.parents[1])
    assert problems(report) == [
        "explorer-0 step 4: buffer records have policy_version 4, the ledger says 3"]
    assert report.stages[0].explorers["explorer-0"]["redone_steps"] == 1

    ledger = LedgerWriter(stage / "ledger", "explorer-1")
    ledger.append("step", step=5, records=0, version=2, seconds=1.0)  # same process, older
    ledger.close()
    assert "explorer-1 step 5 sampled with version 2 after version 4 at step 4 (same " \
        "process)" in problems(audit_run(stage.parents[1]))


def test_cli_exit_codes_table_and_json(stage, tmp_path):
    write_trainer(stage)
    ok = rft("audit", stage.parents[1])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "consumed at most max_uses" in ok.stdout
    assert ok.stdout.strip().splitlines()[-1] == "audit: PASS"

    doc = json.loads(rft("audit", stage.parents[1], "--json").stdout)
    [s] = doc["stages"]
    assert doc["ok"] and s["unconsumed"] == 0 and s["trainer"]["redone_steps"] == 0
    assert {c["check"] for c in s["checks"]} >= {"trainer steps", "published versions increase"}

    with (stage / "ledger" / "trainer.jsonl").open("a") as f:
        f.write(json.dumps({"event": "step", "time": 300.0, "step": 6, "consumed": [],
                            "published": 2}) + "\n")
    failed = rft("audit", stage.parents[1])
    assert failed.returncode == 1
    assert "version 2 published at step 6 after version 5 at step 5" in failed.stdout
    assert failed.stdout.strip().splitlines()[-1] == "audit: FAIL (1 problems)"
    assert json.loads(rft("audit", stage.parents[1], "--json").stdout)["problems"] == 1

    with (stage / "ledger" / "trainer.jsonl").open("a") as f:
        f.write("{not json\n")
    bad = rft("audit", stage.parents[1])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert f"{stage / 'ledger' / 'trainer.jsonl'}:" in bad.stderr.replace("\n", "")
    assert "not a JSON line" in bad.stderr

    nothing = rft("audit", tmp_path / "nowhere")
    assert nothing.returncode == 2 and "not a run directory" in nothing.stderr


def test_a_torn_last_line_is_skipped_and_a_missing_field_is_a_user_error(stage):
    write_trainer(stage)
    path = stage / "ledger" / "trainer.jsonl"
    with path.open("a") as f:
        f.write('{"event": "step", "time": 1')  # killed mid-write
    assert audit_run(stage.parents[1]).ok
    LedgerWriter(stage / "ledger", "trainer").close()  # a new writer cuts the torn line off
    with path.open("a") as f:
        f.write('{"event": "save", "time": 2.0}\n')
    with pytest.raises(UserError, match=r"trainer\.jsonl:\d+: `save` event lacks step"):
        audit_run(stage.parents[1])


def test_archived_segments_are_audited_like_segment_files(stage):
    """After compaction the audit sees the same records and finds the same problems."""
    write_trainer(stage, step_2={"refs": [*batch(2), RecordRef("explorer-0", 0, 1)]})
    before = audit_run(stage.parents[1])
    consumed = {"next_segment": {f"explorer-{e}": STEPS for e in range(EXPLORERS)},
                "pool": {"items": []}, "stuck": {}}
    compact_buffer(stage / "buffer", consumed, CompactConfig(min_segments=2))
    assert list_writer(stage / "buffer" / "explorer-0").archives == [(0, STEPS)]
    after = audit_run(stage.parents[1])
    assert after.stages[0].records == before.stages[0].records
    assert [c.result for c in after.stages[0].checks] == \
        [c.result for c in before.stages[0].checks]
    assert problems(after) == problems(before) == [
        "explorer-0/0/1 consumed 2 times (max_uses 1): steps 1, 2"]
