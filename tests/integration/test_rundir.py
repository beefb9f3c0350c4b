"""Run directory paths and the atomic-write helper."""

import os
import subprocess
import sys

from rft_hpc.core.rundir import RunDir, atomic_write_json, atomic_write_text, read_json


def test_create_lays_out_every_folder(tmp_path):
    run = RunDir(tmp_path / "run").create()
    for folder in (run.buffer, run.weights, run.ckpt, run.state, run.metrics, run.jobs):
        assert folder.is_dir()
    assert (run.root / "RUNDIR_VERSION").read_text() == "1\n"
    assert run.stage(1, "grpo").heartbeat("trainer") == \
        tmp_path / "run" / "stages" / "1-grpo" / "state" / "trainer.json"
    assert run.log("explorer-%a").name == "explorer-%a.log"
    RunDir(tmp_path / "run").create()  # idempotent


def test_atomic_write_replaces_whole_file_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "state" / "cursor.json"
    atomic_write_json(target, {"step": 1})
    atomic_write_json(target, {"step": 2, "pad": "x" * 100_000})
    assert read_json(target)["step"] == 2
    assert os.listdir(target.parent) == ["cursor.json"]


def test_killed_writer_never_leaves_a_partial_file(tmp_path):
    """A process killed while rewriting a file leaves the old or the new content, whole."""
    target = tmp_path / "LATEST"
    atomic_write_text(target, "old\n")
    code = ("import sys; from rft_hpc.core.rundir import atomic_write_text\n"
            "for i in range(10**6): atomic_write_text(sys.argv[1], f'{i}\\n' * 1000)\n")
    for delay in (0.3, 0.5, 0.7):
        proc = subprocess.Popen([sys.executable, "-c", code, str(target)])
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        lines = target.read_text().splitlines()
        assert lines == ["old"] or (len(lines) == 1000 and len(set(lines)) == 1)


def test_a_reader_racing_a_rewriting_writer_only_ever_sees_whole_files(tmp_path):
    """Another process rewrites the file 1500 times while this one reads it in a loop: every
    read is one whole version. (Writing in place, a reader sees a truncated file at once.)"""
    target = tmp_path / "state.txt"
    lines = 20_000  # 40-100 kB: long enough that a write in place is caught half done
    atomic_write_text(target, "0\n" * lines)
    # durable=False: no fsync, so the rewrites follow each other fast and the reads overlap
    # them; what a reader sees does not depend on the fsync
    code = ("import sys; from rft_hpc.core.rundir import atomic_write_text\n"
            f"for i in range(1, 1501): atomic_write_text(sys.argv[1], f'{{i}}\\n' * {lines},"
            " durable=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(target)])
    versions, torn = set(), []
    try:
        while proc.poll() is None:
            text = target.read_text()
            first = text[:text.find("\n") + 1]
            if not first or text != first * lines:
                torn.append(len(text))
            else:
                versions.add(first)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert torn == [], f"{len(torn)} reads saw a partial file (sizes {torn[:5]})"
    assert len(versions) >= 10, f"the reads overlapped too few rewrites: {sorted(versions)}"


def test_atomic_writes_respect_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "shared.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "shared.txt").stat().st_mode & 0o777 == 0o640
