"""A real filesystem that fails like a shared one: `fs.py` (a FUSE passthrough with seeded
faults, metadata delays and late renames) mounted by `FaultMount` for a test or a bench.

    with FaultMount(tmp_path, {"seed": 0, "faults": [...]}) as fs:
        run(..., run_root=fs.path)
        fs.update(faults=[])          # lift the faults while the processes run
        fs.stats()["calls"]["trainer"]["getattr"]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FS = Path(__file__).resolve().with_name("fs.py")


def fuse_usable() -> str | None:
    """None when this machine can mount the filesystem, else why not."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (Debian's fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mfusepy does not load: {exc}"
    return None


class FaultMount:
    """`fs.py` mounted at `root/mnt` over `root/backing`, with its schedule in `root`."""

    def __init__(self, root: Path, schedule: dict[str, Any]) -> None:
        self.root = Path(root)
        self.backing = self.root / "backing"
        self.path = self.root / "mnt"
        self.schedule_file = self.root / "faultfs.json"
        self.log = self.root / "faults.jsonl"
        self.stats_file = self.root / "faultfs-stats.json"
        self.schedule = {"log": str(self.log), "stats": str(self.stats_file), **schedule}
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> FaultMount:
        why = fuse_usable()
        if why:
            raise RuntimeError(f"cannot mount the fault filesystem: {why}")
        self.backing.mkdir(parents=True, exist_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        self._write()
        out = open(self.root / "faultfs.log", "ab")
        self.process = subprocess.Popen([sys.executable, str(FS), str(self.backing),
                                         str(self.path), str(self.schedule_file)],
                                        stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("the fault filesystem did not mount: " +
                                   (self.root / "faultfs.log").read_text()[-2000:])
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if os.path.ismount(self.path) and subprocess.run(
                ["fusermount3", "-u", str(self.path)], capture_output=True).returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        if self.process is not None:
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def update(self, **changes: Any) -> None:
        """Change the schedule in force (e.g. `faults=[]` lifts a full disk); the filesystem
        reads it within a fraction of a second (waited for here)."""
        self.schedule.update(changes)
        self._write()
        time.sleep(0.5)

    def _write(self) -> None:
        tmp = self.schedule_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.schedule))
        os.replace(tmp, self.schedule_file)
        # a later mtime than the one read, even within the filesystem's timestamp granularity
        os.utime(self.schedule_file, ns=(time.time_ns(), time.time_ns()))

    def stats(self) -> dict[str, Any]:
        """Calls per process name and kind, faults met per process (`fs.py`): as last
        written (within half a second while mounted, complete after unmounting)."""
        if not self.stats_file.exists():
            return {"calls": {}, "faults": {}}
        return json.loads(self.stats_file.read_text())

    def fired(self) -> list[dict[str, Any]]:
        """Every fault struck so far, in order."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]
