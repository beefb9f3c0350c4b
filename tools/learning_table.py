"""Run the suite's learning tests at several seeds and thread counts, and print their table.

A learning test must pass far inside its bound at every seed and with one or two threads per
role (tests/helpers/learning.py), not only at the suite's seed 0 on one thread. Each cell (a
test file at one seed and thread count) runs as its own pytest process; its figures come from
the tests themselves (`RFT_LEARN_RECORD`) and its outcomes from pytest's JUnit report.

    python tools/learning_table.py --seeds 0 1 2 --threads 1 2 \\
        tests/integration/test_real_workload.py tests/integration/test_rl_algorithms_learn.py \\
        tests/integration/test_tool_recipe.py

`--jobs 2` runs two cells at once (one-thread cells on a 2-core machine). Output: a Markdown
table on stdout, and each cell's log, report and records under `--out`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cell(test_file: str, seed: int, threads: int, out: Path) -> Path:
    """Run one test file at `seed` and `threads` (no test workers); its folder under `out`."""
    cell = out / f"{Path(test_file).stem}-s{seed}-t{threads}"
    cell.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RFT_LEARN_SEED": str(seed), "RFT_LEARN_THREADS": str(threads),
           "RFT_LEARN_RECORD": str(cell / "records.jsonl")}
    with open(cell / "pytest.log", "w") as log:
        subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-s", "-q", test_file,
                        f"--junitxml={cell / 'junit.xml'}"],
                       cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    return cell


def outcomes(cell: Path) -> dict[str, str]:
    """Each test's outcome in a cell's JUnit report: passed, failed or skipped."""
    if not (cell / "junit.xml").exists():
        return {}
    found = {}
    for case in ET.parse(cell / "junit.xml").iter("testcase"):
        kinds = {child.tag for child in case}
        found[case.get("name", "?")] = ("failed" if kinds & {"failure", "error"}
                                        else "skipped" if "skipped" in kinds else "passed")
    return found


def table(cells: list[Path]) -> str:
    """The Markdown table of every recorded figure, a row per test and cell."""
    lines = ["| test | seed | threads | before -> after | b / c | p | cell outcome |",
             "|---|---|---|---|---|---|---|"]
    for cell in cells:
        results = outcomes(cell)
        failed = sorted(name for name, kind in results.items() if kind == "failed")
        verdict = f"{len(results) - len(failed)} passed" + (
            f", FAILED: {', '.join(failed)}" if failed else "")
        path = cell / "records.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
            else []
        for r in rows:
            bc = f"{r['b']} / {r['c']}" if "b" in r else ""
            p = f"{r['p']:.2g}" if "p" in r else ""
            lines.append(f"| {r['test']} | {r['seed']} | {r['threads']} | "
                         f"{100 * r['before']:.1f} -> {100 * r['after']:.1f} % | {bc} | {p} | "
                         f"{verdict} |")
        if not rows:
            lines.append(f"| {cell.name} | | | | | | {verdict or 'no report'} |")
    return "\n".join(lines)


def main() -> None:
    """Parse the arguments, run every cell, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="learning test files")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once")
    parser.add_argument("--out", type=Path, default=Path("runs/learning-table"))
    args = parser.parse_args()
    grid = list(itertools.product(args.files, args.seeds, args.threads))
    with ThreadPoolExecutor(args.jobs) as pool:
        cells = list(pool.map(lambda c: run_cell(*c, args.out.resolve()), grid))
    print(table(cells))


if __name__ == "__main__":
    main()
