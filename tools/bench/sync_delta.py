"""Delta rows of tools/bench/sync.py (`--delta`): delta versions against whole ones.

For the demo's tiny model (~1 M parameters) and a locally built ~79 M parameter Llama
(hidden 640, 16 layers, as tools/bench/lora.py builds it), each in bfloat16 and in float32
(`model.dtype`), a `Trainer` (AdamW, lr 1e-5, GRPO on a fixed batch of 4 rollouts) takes
`steps` steps; the state dict after each is one version. Every version is published twice,
alternately, into two weights folders: whole (`publish_weights`) and, but the first, as a
delta against the version before (`delta_of`, what `sync.full_every` > 1 does). Per version
it measures the bytes written (the delta file against `model.safetensors`), the publish
seconds (written and fsynced), and the apply seconds: `load_weights` of the whole version
into a reused read buffer, against `load_weights` of the delta applied to the version the
reader holds (`held`). Each figure is the median over versions 2..steps, each ratio the
median of the versions' own ratios (delta / whole); every delta load is checked
bit-identical to the whole version's.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

MODELS = ("demo", "79M")


def trained_versions(model: Path, dtype: str, folder: Path) -> tuple[int, Iterator[dict]]:
    """The model's parameter count, and the CPU state dicts of `model` in `dtype` after each
    GRPO step at lr 1e-5 (AdamW, one thread, the same 4 rollouts of 32 tokens every step),
    without end: what each bench row publishes."""
    import numpy as np
    import torch

    from rft_hpc.buffer.reader import Batch
    from rft_hpc.buffer.records import Experience
    from rft_hpc.config import ExperimentConfig
    from rft_hpc.trainer.trainer import Trainer

    torch.set_num_threads(1)
    config = ExperimentConfig.model_validate({
        "run": {"root": str(folder), "seed": 0}, "model": {"path": str(model), "dtype": dtype},
        "trainer": {"lr": 1e-5, "batch_size": 4}, "algorithm": {"algorithm_type": "grpo"}})
    trainer = Trainer(config)
    rng = np.random.default_rng(0)
    records = [Experience(rng.integers(4, 20, 32), prompt_length=8, reward=float(i % 2),
                          group_id=0, logprobs=np.full(32, -3.0, dtype=np.float32))
               for i in range(4)]

    def versions() -> Iterator[dict]:
        while True:
            trainer.step(Batch(records=list(records), weights=[1.0] * 4, uses=[0] * 4))
            yield {n: t.detach().to("cpu", copy=True)
                   for n, t in trainer.full_state_dict().items()}

    return sum(p.numel() for p in trainer.model.parameters()), versions()


def _worker(model: Path, dtype: str, steps: int, folder: Path) -> dict:
    """One (model, dtype) row, in a process of its own."""
    import torch

    from rft_hpc.sync.delta import DELTA_FILE
    from rft_hpc.sync.storage import ReadBuffer, wait_for_deletions
    from rft_hpc.sync.weight_files import load_weights, publish_weights, version_dir

    parameters, versions = trained_versions(model, dtype, folder)
    whole_dir, delta_dir = folder / "whole", folder / "delta"
    buffer = ReadBuffer()
    prev, held, rows = None, None, []
    for version in range(1, steps + 1):
        state = next(versions)
        t0 = time.perf_counter()
        publish_weights(whole_dir, state, version, keep=1)
        t1 = time.perf_counter()
        publish_weights(delta_dir, state, version, keep=1, delta_of=prev)
        t2 = time.perf_counter()
        whole = load_weights(whole_dir, version, buffer)
        t3 = time.perf_counter()
        got = load_weights(delta_dir, version, held=held)
        t4 = time.perf_counter()
        for name, t in whole.items():
            if not torch.equal(got[name].reshape(-1).view(torch.uint8),
                               t.reshape(-1).view(torch.uint8)):
                raise SystemExit(f"v{version} {name}: delta sync differs from whole")
        wait_for_deletions()
        if prev is not None:
            rows.append({
                "whole_bytes": (version_dir(whole_dir, version) / "model.safetensors")
                .stat().st_size,
                "delta_bytes": (version_dir(delta_dir, version) / DELTA_FILE).stat().st_size,
                "whole_publish": t1 - t0, "delta_publish": t2 - t1,
                "whole_apply": t3 - t2, "delta_apply": t4 - t3})
        prev, held = (version, state), (version, got)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    for what in ("bytes", "publish", "apply"):
        med[f"{what}_ratio"] = statistics.median(r[f"delta_{what}"] / r[f"whole_{what}"]
                                                 for r in rows)
    med["parameters"] = parameters
    return med


def run(steps: int, models: list[str]) -> list[dict]:
    """Build the models, bench each (model, dtype) in its own process, print the rows."""
    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="rft-bench-sync-delta-"))
    results = []
    try:
        for name in models:
            spec = TinyModelSpec() if name == "demo" else TinyModelSpec(  # as bench/lora.py
                hidden_size=640, intermediate_size=640 * 27 // 10, num_layers=16, num_heads=10)
            model = init_tiny_model(folder / f"model-{name}", spec)
            for dtype in ("bfloat16", "float32"):
                work = folder / f"{name}-{dtype}"
                work.mkdir()
                out = subprocess.run([sys.executable, __file__, str(model), dtype, str(steps),
                                      str(work)], text=True, capture_output=True, check=False)
                if out.returncode:
                    sys.exit(f"delta bench {name} {dtype} failed:\n{out.stderr[-3000:]}")
                results.append({"model": name, "dtype": dtype,
                                **json.loads(out.stdout.strip().splitlines()[-1])})
                shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\ndelta versions (AdamW lr 1e-5, median of versions 2..{steps}; ratios delta/whole)")
    print(f"{'model':>6} {'params':>7} {'dtype':>9} {'whole MB':>9} {'delta MB':>9} "
          f"{'bytes':>6} {'pub s whole':>11} {'delta':>7} {'ratio':>6} "
          f"{'apply s whole':>13} {'delta':>7} {'ratio':>6}")
    for r in results:
        print(f"{r['model']:>6} {r['parameters'] / 1e6:>6.1f}M {r['dtype']:>9} "
              f"{r['whole_bytes'] / 1e6:>9.2f} {r['delta_bytes'] / 1e6:>9.2f} "
              f"{r['bytes_ratio']:>6.3f} {r['whole_publish']:>11.4f} {r['delta_publish']:>7.4f} "
              f"{r['publish_ratio']:>6.2f} {r['whole_apply']:>13.4f} {r['delta_apply']:>7.4f} "
              f"{r['apply_ratio']:>6.2f}")
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    model_arg, dtype_arg, steps_arg, folder_arg = sys.argv[1:5]
    print(json.dumps(_worker(Path(model_arg), dtype_arg, int(steps_arg), Path(folder_arg))))
