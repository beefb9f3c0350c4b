"""The trainer on several ranks: real processes, gloo, a file rendezvous, no mocks.

Each rank is a separate Python process started the way a launcher starts one (this file run
as a script, or `rft-hpc role trainer`), with RANK / WORLD_SIZE / LOCAL_RANK and
RFT_DIST_INIT_FILE in its environment.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.paths import ROOT
from helpers.ranks import (
    finish,
    fixed_batch,
    grpo_shards,
    rank_env,
    sft_stage,
    start_ranks,
    trainer_command,
    write_config,
)

from rft_hpc.buffer.reader import Batch
from rft_hpc.runtime.lifecycle import REQUEUE_EXIT
from rft_hpc.trainer.distributed import (
    ENV_INIT_FILE,
    Launch,
    launch_from_env,
    loss_tokens,
)

# -- one step on a fixed batch ---------------------------------------------------------------


def step_worker(config_path: str, algorithm: str, out: str) -> None:
    """One rank of `test_one_step_on_two_ranks_matches_one_process` (run as a script)."""
    from rft_hpc.config import load_config
    from rft_hpc.trainer.distributed import init_distributed, shutdown
    from rft_hpc.trainer.trainer import Trainer

    torch.set_num_threads(1)
    ctx = init_distributed()
    trainer = Trainer(load_config(Path(config_path)), ctx)
    values = trainer.step(fixed_batch(algorithm) if ctx.is_main else None)
    torch.save({"params": {k: p.detach().clone() for k, p in trainer.model.named_parameters()},
                "grads": {k: p.grad.clone() for k, p in trainer.model.named_parameters()},
                "values": values}, Path(out) / f"rank{ctx.rank}-of-{ctx.world_size}.pt")
    shutdown()


def max_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float,
                                                                                      float]:
    """Largest absolute and relative (to max |a|) difference over all tensors."""
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    rel = max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-30)) for k in a)
    return diff, rel


@pytest.mark.parametrize("algorithm", ["grpo", "sft", "ppo"])
def test_one_step_on_two_ranks_matches_one_process(tmp_path, tiny_model, algorithm):
    trainer = {"lr": 1e-3, "batch_size": 8, "grad_clip": 1.0, "weight_decay": 0.01}
    kl = {"kl_loss_fn": "k3", "kl_loss_fn_args": {"kl_coef": 0.05}} if algorithm == "grpo" else {}
    config = write_config(tmp_path / "config.yaml", tiny_model, trainer=trainer,
                          algorithm={"algorithm_type": algorithm, **kl})
    args = [sys.executable, __file__, "step", str(config), algorithm, str(tmp_path)]
    results = finish(start_ranks(args, 1, None) + start_ranks(args, 2, tmp_path / "rdzv"))
    assert all(rc == 0 for rc, _ in results), [err[-2000:] for _, err in results]

    one = torch.load(tmp_path / "rank0-of-1.pt")
    two = [torch.load(tmp_path / f"rank{r}-of-2.pt") for r in range(2)]
    for key in ("params", "grads"):  # the replicas are bitwise identical
        assert all(torch.equal(two[0][key][k], two[1][key][k]) for k in two[0][key])
    grad_abs, grad_rel = max_differences(one["grads"], two[0]["grads"])
    weight_abs, weight_rel = max_differences(one["params"], two[0]["params"])
    clear = max(float((one["params"][k] - two[0]["params"][k]).abs()[g.abs() >= 1e-6].max())
                for k, g in one["grads"].items() if bool((g.abs() >= 1e-6).any()))
    print(f"{algorithm}: 1 vs 2 ranks: max |grad diff| {grad_abs:.3g} (rel {grad_rel:.3g}), "
          f"max |weight diff| {weight_abs:.3g} (rel {weight_rel:.3g}), "
          f"{clear:.3g} where |grad| >= 1e-6")
    lr, eps = trainer["lr"], 1e-8  # AdamW's default eps
    for k, p in one["params"].items():
        g1, g2, p2 = one["grads"][k], two[0]["grads"][k], two[0]["params"][k]
        # the gradient (summed over the ranks, clipped) is that of the whole batch
        assert float((g2 - g1).abs().max()) <= 2e-6 * float(g1.abs().max()), k
        # AdamW's first step moves each weight by lr * g / (|g| + eps) (+ decay): float noise
        # in g moves it by at most lr * |dg| / eps, which matters only where |g| ~ eps
        bound = 1e-7 + 1e-6 * p.abs() + lr * (g2 - g1).abs() / eps
        assert bool(((p2 - p).abs() <= bound).all()), k
        clear_grad = g1.abs() >= 1e-6
        torch.testing.assert_close(p2[clear_grad], p[clear_grad], rtol=1e-6, atol=1e-7, msg=k)
    v1, v2 = one["values"], two[0]["values"]
    assert list(v1) == list(v2)  # the same metrics, in the same order
    assert v1["tokens"] == v2["tokens"] == loss_tokens(fixed_batch(algorithm).records)
    for key in v1:
        assert v2[key] == pytest.approx(v1[key], rel=1e-5, abs=1e-7), key
    if algorithm == "grpo":
        assert v1["unknown_logprob_records"] == 1.0 and "kl_ref" in v1


def test_shards_cover_the_batch_with_whole_batch_advantages():
    batch = fixed_batch("grpo")
    shards = grpo_shards(batch, 3)
    assert [len(s.records) for s in shards] == [2, 3, 3]
    assert [r for s in shards for r in s.records] == batch.records
    adv = torch.cat([s.advantages for s in shards])
    alone = grpo_shards(batch, 1)[0].advantages
    assert torch.equal(adv, alone) and adv[7] != 0  # group 9 spans two shards
    assert {s.num_tokens for s in shards} == {loss_tokens(batch.records)}
    tiny = Batch(records=batch.records[:1], weights=[1.0], uses=[0])
    assert [len(s.records) for s in grpo_shards(tiny, 2)] == [0, 1]


# -- the whole role ------------------------------------------------------------------------

def test_run_trainer_on_two_ranks(tmp_path, tiny_model):
    from rft_hpc.monitor.metrics import read_metrics
    from rft_hpc.sync.weight_files import latest_weights_version, load_weights

    stage = sft_stage(tmp_path, tiny_model, "two")
    alone = sft_stage(tmp_path, tiny_model, "one")
    procs = start_ranks(trainer_command(stage), 2, stage / "state" / "dist-1")
    procs += start_ranks(trainer_command(alone), 1, None)
    results = finish(procs)
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]

    rows = read_metrics(stage / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]  # one writer: rank 0
    assert [r["step"] for r in rows if r.get("eval_accuracy") is not None] == [0, 2, 4]
    assert (stage / "ckpt" / "LATEST").read_text().strip() == "trainer/step-000004"
    heartbeat = json.loads((stage / "state" / "trainer.json").read_text())
    assert heartbeat["status"] == "done" and heartbeat["pid"] == procs[0].pid
    assert latest_weights_version(stage / "weights") == 4

    two = load_weights(stage / "weights", 4)
    one = load_weights(alone / "weights", 4)
    diff, rel = max_differences(one, two)
    print(f"run_trainer, 4 SFT steps, 1 vs 2 ranks: max |weight diff| {diff:.3g} "
          f"(rel {rel:.3g})")
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-6, msg=k)
    losses = [[r["loss"] for r in read_metrics(s / "metrics" / "trainer.jsonl") if "loss" in r]
              for s in (alone, stage)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def wait_for_step(stage: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((stage / "state" / "trainer.json").read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"the trainer never reached step {step}")


def test_a_stop_signal_to_rank_0_stops_every_rank_after_a_save(tmp_path, tiny_model):
    stage = sft_stage(tmp_path, tiny_model, "stop", steps=10_000, save_interval=10_000,
                      batch_size=4)
    procs = start_ranks(trainer_command(stage), 2, stage / "state" / "dist-1")
    wait_for_step(stage, 2)
    procs[0].send_signal(signal.SIGUSR2)  # Slurm's warning, to rank 0 only
    results = finish(procs, timeout=120)
    # rank 0 saved and asks its job to be requeued; the other rank simply followed
    assert [rc for rc, _ in results] == [REQUEUE_EXIT, 0], [err[-3000:] for _, err in results]
    assert "asking to be requeued (requeue)" in results[0][1]
    heartbeat = json.loads((stage / "state" / "trainer.json").read_text())
    assert heartbeat["status"] == "stopped" and heartbeat["step"] >= 2
    saved = (stage / "ckpt" / "LATEST").read_text().strip()
    assert saved == f"trainer/step-{heartbeat['step']:06d}"


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_warning_signals_from_start_to_exit_never_kill_the_role(tmp_path, tiny_model):
    # Slurm sends USR2 up to a minute early: while the role still imports torch, or while it
    # exits after its own walltime stop. Either used to kill it (exit -12, counted a crash).
    stage = sft_stage(tmp_path, tiny_model, "early", steps=10_000, save_interval=10_000,
                      batch_size=4)
    proc = start_ranks(trainer_command(stage), 1, None)[0]
    deadline = time.monotonic() + 60
    while not catches(proc.pid, signal.SIGUSR2):  # python's own start-up: nothing to catch
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    sent = 0
    while proc.poll() is None:  # every 5 ms until it has exited
        proc.send_signal(signal.SIGUSR2)
        sent += 1
        time.sleep(0.005)
    rc, err = finish([proc])[0]
    assert rc == REQUEUE_EXIT, (sent, err[-3000:])
    assert "asking to be requeued (requeue)" in err
    heartbeat = json.loads((stage / "state" / "trainer.json").read_text())
    assert heartbeat["status"] == "stopped"
    assert (stage / "ckpt" / "LATEST").read_text().strip() == \
        f"trainer/step-{heartbeat['step']:06d}"


def test_a_rank_killed_mid_run_does_not_hang_the_other(tmp_path, tiny_model):
    stage = sft_stage(tmp_path, tiny_model, "kill", steps=10_000, save_interval=10_000,
                      batch_size=4)
    procs = start_ranks(trainer_command(stage), 2, stage / "state" / "dist-1")
    wait_for_step(stage, 2)
    procs[0].kill()
    t0 = time.monotonic()
    rc, _ = finish(procs[1:], timeout=60)[0]
    print(f"rank 1 exited {time.monotonic() - t0:.1f} s after rank 0 was killed")
    assert rc != 0
    procs[0].wait()


def test_followers_outwait_the_timeout_while_rank_0_waits_for_data(tmp_path, tiny_model):
    """No data for longer than the collective timeout: keepalives hold the ranks together;
    when the explorers are done and nothing came, every rank stops cleanly."""
    from rft_hpc.config import load_config
    from rft_hpc.run.stages import prepare_model, prepare_stage

    path = write_config(tmp_path / "wait.yaml", tiny_model, mode="both",
                        trainer={"batch_size": 4, "steps": 3},
                        buffer={"poll_interval": 0.05},
                        tasks={"type": "arithmetic", "digits": 1, "eval_size": 4})
    stage = tmp_path / "wait"
    prepare_stage(prepare_model(load_config(path)), stage, None)
    env_timeout = {"RFT_DIST_TIMEOUT": "3"}
    procs = [subprocess.Popen(trainer_command(stage), cwd=ROOT, text=True,
                              env={**rank_env(r, 2, stage / "state" / "dist-1"), **env_timeout},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    metrics = stage / "metrics" / "trainer.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text()):  # step-0 eval: the loop starts
        assert time.monotonic() < deadline and [p.poll() for p in procs] == [None, None]
        time.sleep(0.1)
    time.sleep(10)  # over three timeouts: a rank left in one collective that long would fail
    if [p.poll() for p in procs] != [None, None]:
        for p in procs:
            p.kill()
        pytest.fail(f"a rank exited while rank 0 waited for data: "
                    f"{[err[-1500:] for _, err in finish(procs)]}")
    (stage / "state" / "explorer-0.json").write_text(json.dumps({"status": "done"}))
    results = finish(procs, timeout=60)
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]
    heartbeat = json.loads((stage / "state" / "trainer.json").read_text())
    assert heartbeat["status"] == "done" and heartbeat["step"] == 0


def wait_for_file(path: Path, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail(f"{path.name} never appeared: {[e[-2000:] for _, e in finish(procs)]}")
        time.sleep(0.05)


def test_an_idle_sharded_trainer_gathers_once_per_version(tmp_path, tiny_model):
    """Two FSDP ranks waiting for data past `sync.idle_publish` write each new version as
    files once: one gather of the whole model per version, not one per poll of the buffer
    (about 20 polls a second here)."""
    from rft_hpc.buffer.writer import SegmentWriter
    from rft_hpc.config import load_config
    from rft_hpc.monitor.metrics import read_metrics
    from rft_hpc.run.stages import prepare_model, prepare_stage
    from rft_hpc.sync.weight_files import latest_weights_version

    path = write_config(tmp_path / "idle.yaml", tiny_model, mode="both",
                        trainer={"batch_size": 4, "steps": 3, "save_interval": 100,
                                 "parallel": "fsdp"},
                        sync={"interval": 100, "idle_publish": 0.0},
                        buffer={"poll_interval": 0.05},
                        tasks={"type": "arithmetic", "digits": 1, "eval_size": 2},
                        eval={"max_new_tokens": 2})
    stage = tmp_path / "idle"
    prepare_stage(prepare_model(load_config(path)), stage, None)
    procs = start_ranks(trainer_command(stage), 2, stage / "state" / "dist-1")
    writer = SegmentWriter(stage / "buffer", "explorer-0", "rl")
    records = fixed_batch("grpo").records
    for step in (0, 1):  # one trainer step each, then a wait on an empty buffer
        writer.write_step(step, records[4 * step:4 * step + 4])
        wait_for_file(stage / "weights" / f"v{step + 1:06d}" / "manifest.json", procs)
        time.sleep(1.5)  # some 30 polls of the empty buffer, each past idle_publish
    writer.close()
    (stage / "state" / "explorer-0.json").write_text(json.dumps({"status": "done"}))
    results = finish(procs, timeout=120)
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]
    rows = read_metrics(stage / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert latest_weights_version(stage / "weights") == 2
    # the evaluations at the start and the end, and v1 and v2 each written once while idle
    # (the end finds v2 written already)
    assert rows[-1]["weights_gathered"] == 4, [r.get("weights_gathered") for r in rows]


def test_launch_from_the_environment(tmp_path):
    assert launch_from_env({}) == Launch(0, 1, 0, None)
    assert launch_from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}) == Launch(0, 1, 0, None)
    rdzv = tmp_path / "dist-7"
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
             ENV_INIT_FILE: str(rdzv)}
    assert launch_from_env(slurm) == Launch(3, 4, 1, f"file://{rdzv}")
    assert launch_from_env({**slurm, "SLURM_RESTART_COUNT": "2"}).init_method \
        == f"file://{rdzv}.r2"
    torchrun = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": "29500", **slurm}
    assert launch_from_env(torchrun) == Launch(2, 4, 0, f"file://{rdzv}")
    del torchrun[ENV_INIT_FILE]
    assert launch_from_env(torchrun).init_method == "env://"
    assert launch_from_env({"WORLD_SIZE": "1"}) == Launch(0, 1, 0, None)
    with pytest.raises(ValueError, match="no rendezvous"):
        launch_from_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK"):
        launch_from_env({"WORLD_SIZE": "2", ENV_INIT_FILE: str(rdzv)})


if __name__ == "__main__" and sys.argv[1] == "step":
    from rft_hpc.runtime.exit import leave_process

    step_worker(*sys.argv[2:])
    leave_process(0)  # as `rft-hpc role trainer` ends: not through gloo's teardown
