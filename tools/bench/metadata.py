#!/usr/bin/env python
"""Benchmark the loop on a filesystem with slow metadata: completions/s with no delay and with
`--delay` seconds (default 20 ms) per metadata call, and each role's metadata calls per step.

    python tools/bench/metadata.py [--steps 30] [--delay 0.02] [--tuned SET ...] [--json OUT]

A busy metadata server (Lustre's MDS, an NFS server under load) answers every stat, open,
create, rename, listdir and unlink tens of milliseconds late. Each of the demo's GRPO stage
(2 explorers, a trainer, checkpoint-file weight sync every step) runs twice on the test
tree's fault filesystem (tests/helpers/faultfs, FUSE; needs Debian's fuse3 and mfusepy, which
`tools/install.sh --test` installs): with no delay and with `--delay`. The filesystem counts
the calls that reach it, per process (the kernel's 1 s attribute cache answers repeats, as an
NFS client's does). Printed per run: the stage's completions/s (rollouts trained per second
of the stage) and its ratio to the undelayed run; per role: metadata calls per step (a
trainer step, an explorer step; the launcher per trainer step) in both runs and their ratio.
A loop whose polls multiplied under slow metadata would show a ratio well above 1; the
figure is the ratio, not a time. A third run, tuned (`--tuned`, default `sync.interval=2`:
weights published every second step, half the publishes and the explorers' loads, one more
step of staleness allowed), runs on the delayed filesystem.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers.faultfs import FaultMount  # noqa: E402
from helpers.faultfs.fs import METADATA  # noqa: E402

STAGE = Path("demo") / "stages" / "0-main"


def run_stage(tmp: Path, model: Path, steps: int, delay: float, *sets: str) -> dict:
    """The demo's GRPO stage (with `--set` overrides `sets`) on a fault filesystem with
    `delay` per metadata call: its completions/s and each role's metadata calls per step."""
    root = tmp / f"delay-{delay:g}-{len(sets)}"
    with FaultMount(root, {"faults": [], "metadata_delay": delay}) as fs:
        cmd = [sys.executable, "-m", "rft_hpc.cli", "run", str(REPO / "configs" / "demo.yaml"),
               "--set", f"run.root={fs.path}", "--set", f"model.path={model}",
               "--set", "stages=[]", "--set", "eval.interval=0", "--set",
               "tasks.eval_size=16", "--set", f"trainer.steps={steps}",
               "--set", f"trainer.save_interval={max(1, steps // 3)}",
               *(arg for item in sets for arg in ("--set", item))]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if proc.returncode:
            raise SystemExit(f"the run failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    calls = fs.stats()["calls"]  # complete once unmounted; the files are read from the backing
    summary = json.loads((fs.backing / "demo" / "summary.json").read_text())
    steps_of = role_steps(fs.backing / STAGE)
    seconds = summary["stages"][0]["seconds"]
    out = {"delay": delay, "sets": list(sets), "seconds": seconds,
           "completions_per_s": completions(fs.backing / STAGE) / seconds,
           "calls_per_step": {}}
    for name, ops in sorted(calls.items()):
        role = "launcher" if name == "run" else name
        per = steps_of.get(role, steps_of["trainer"] if role == "launcher" else 0)
        if per:
            out["calls_per_step"][role] = sum(n for op, n in ops.items() if op in METADATA) / per
    return out


def completions(stage: Path) -> int:
    """Rollouts in the stage's buffer (every one was trained on: the stage finished)."""
    from rft_hpc.buffer.jsonl import iter_segments
    from rft_hpc.buffer.segment import read_segment

    return sum(len(read_segment(p).records()) for _, p in iter_segments(stage / "buffer"))


def role_steps(stage: Path) -> dict[str, int]:
    """Steps each role took, from its metrics (the last `step` it logged)."""
    steps = {}
    for path in (stage / "metrics").glob("*.jsonl"):
        last = 0
        for line in path.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line).get("step", 0)))
            except (ValueError, TypeError, AttributeError):
                continue
        steps[path.stem] = last
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="trainer steps per run")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds per metadata call")
    parser.add_argument("--tuned", nargs="*", default=["sync.interval=2"],
                        help="--set overrides of the tuned run (on the delayed filesystem)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    from rft_hpc.models.tiny import init_tiny_model

    with tempfile.TemporaryDirectory(prefix="rft-bench-metadata-") as tmp:
        model = init_tiny_model(Path(tmp) / "model")
        base, slow = (run_stage(Path(tmp), model, args.steps, d) for d in (0.0, args.delay))
        tuned = run_stage(Path(tmp), model, args.steps, args.delay, *args.tuned)
    ms = f"{args.delay * 1000:g} ms"
    print(f"demo GRPO stage, {args.steps} trainer steps: default config, and tuned "
          f"({' '.join(args.tuned)}) at {ms}")
    print(f"  completions/s  no delay {base['completions_per_s']:.1f}   "
          f"{ms} per metadata call {slow['completions_per_s']:.1f} (ratio "
          f"{slow['completions_per_s'] / base['completions_per_s']:.2f})   tuned "
          f"{tuned['completions_per_s']:.1f} (ratio "
          f"{tuned['completions_per_s'] / base['completions_per_s']:.2f})")
    print(f"  {'role':<12} {'calls/step':>10} {'at ' + ms:>10} {'ratio':>6} {'tuned':>8}")
    for role, per in base["calls_per_step"].items():
        later = slow["calls_per_step"].get(role, 0.0)
        print(f"  {role:<12} {per:>10.1f} {later:>10.1f} {later / per if per else 0:>6.2f} "
              f"{tuned['calls_per_step'].get(role, 0.0):>8.1f}")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "runs": [base, slow, tuned]},
                                        indent=2))


if __name__ == "__main__":
    main()
