"""The launcher's commands run on a login node, often many times a minute (`rft-hpc
status`): their modules must not import torch, transformers or vLLM, which take a second
or more to import (the evaluation's judge loaders once pulled torch in through vLLM's
engine, and `rft-hpc status` went from 0.5 s to 1.9 s)."""

from __future__ import annotations

import subprocess
import sys

LAUNCHER = ("rft_hpc.cli.app", "rft_hpc.launch.status", "rft_hpc.launch.submit",
            "rft_hpc.launch.resume", "rft_hpc.ledger.audit")
HEAVY = ("torch", "transformers", "vllm")


def test_the_launchers_modules_import_no_torch_transformers_or_vllm() -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in LAUNCHER)
            + f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
