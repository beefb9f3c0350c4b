"""Where the test suite's CPU goes, test by test: for keeping it within its time budget.

The suite is CPU-bound on CI's 2 cores (the cores stay ~96 % busy), so its wall time is
the CPU its tests burn, divided by the cores. A test's own process shows little of it: the
runs it starts fork their roles from fork servers and Slurm jobs, which are not its
children. This tool follows the processes instead:

    python tools/suite_cpu.py run [pytest args...]   # the suite, sampled; then the table
    python tools/suite_cpu.py table SAMPLES.json     # the table of an earlier sampling

`run` starts pytest with a plugin (this module) that puts each test's id in the environment
(`RFT_TEST_ID`), which every process a test starts inherits, Slurm jobs included; a sampler
reads each process's CPU time and that variable from /proc once a second. A process that
lives less than a second, or started before the suite (the pytest workers themselves and
their in-process tests), is not attributed.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

ENV = "RFT_TEST_ID"
TICKS = os.sysconf("SC_CLK_TCK")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every process the test starts from now on carries its id."""
    os.environ[ENV] = item.nodeid


def _sample(seen: dict[tuple[int, int], list]) -> None:
    """Each process's CPU seconds so far, and its test id when first seen."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_bytes()
            fields = raw.rpartition(b")")[2].split()
            cpu, key = (int(fields[11]) + int(fields[12])) / TICKS, (int(name), int(fields[19]))
            if key not in seen:
                env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
                test = next((e[len(ENV) + 1:].decode(errors="replace") for e in env
                             if e.startswith(ENV.encode() + b"=")), None)
                seen[key] = [cpu, cpu, test]  # first, latest, test
            seen[key][1] = cpu
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile


def run(pytest_args: list[str], out: Path) -> int:
    """The suite under the sampler; the samples go to `out` (JSON), the table to stdout."""
    seen: dict[tuple[int, int], list] = {}
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(1.0):
            _sample(seen)

    thread = threading.Thread(target=sampler, daemon=True)
    _sample(seen)
    thread.start()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_cpu", *pytest_args],
                           env=env)
    done.set()
    thread.join()
    _sample(seen)
    # CPU used while sampled: since first seen for processes of a test, nothing else counts
    rows = [[pid, latest - first if test is None else latest, test]
            for (pid, _), (first, latest, test) in seen.items()]
    out.write_text(json.dumps(rows))
    table(out)
    return code


def table(samples: Path, top: int = 40) -> None:
    """CPU seconds by test file and by test, largest first."""
    rows = json.loads(samples.read_text())
    by_test: collections.Counter[str] = collections.Counter()
    rest = 0.0
    for _, cpu, test in rows:
        if test:
            by_test[test] += cpu
        else:
            rest += cpu
    by_file: collections.Counter[str] = collections.Counter()
    for test, cpu in by_test.items():
        by_file[test.split("::")[0]] += cpu
    print(f"attributed {sum(by_test.values()):.0f} CPU-s; not attributed {rest:.0f}")
    for title, counts in (("file", by_file), ("test", by_test)):
        print(f"--- by {title}")
        for name, cpu in counts.most_common(top):
            print(f"{cpu:8.1f}  {name}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "table":
        table(Path(sys.argv[2]))
    elif len(sys.argv) >= 2 and sys.argv[1] == "run":
        sys.exit(run(sys.argv[2:], Path("suite-cpu.json")))
    else:
        sys.exit(__doc__)
