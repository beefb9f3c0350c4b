#!/usr/bin/env python
"""Benchmark the whole RFT loop against this machine's limits, in one run.

    python tools/bench/pipeline.py [--steps 16] [--runs 1] [--tokens 5] [--json OUT]

The batch shape is the demo's: the tiny Llama, 8 tasks x 8 rollouts of 5 tokens, a trainer
batch of 64 (one explorer step), GRPO, weights synced through checkpoint files after every
step. It measures, each figure beside the limit it is held to, in the same run:

(a) pure generation time `t_gen` of one explorer step (HFEngine.generate) and pure train-step
    time `t_train` of one such batch (Trainer.step), each in a process of its own, on one
    core (pinned, 1 thread) and on all cores, back to back (medians of 15); and, as a
    diagnostic held to no target, the same on one core after 0.1 s of sleep before each,
    as a role runs when the roles take turns (this machine runs the first step after an
    idle spell slower); and the ceiling of any synchronous loop: one process that generates
    a step and trains on it, back to back, with no second process, sync or files; and the
    colocated mechanism alone: the two loops in threads of one process, their compute on
    one device thread, weights through the in-memory handover, and nothing else (no buffer,
    ledger, metrics, heartbeats or logs): what (b) colocated would reach without its
    bookkeeping (tools/bench/pipeline_timings.py);
(b) shared cores, as `rft-hpc run` on a laptop: the loop's completions/s with the default
    settings (`sync.offset: 0`, threads left to rft-hpc), which run the explorer and the
    trainer colocated in one process (`launch.colocate: auto`), against 64 / (t_gen +
    t_train) on all cores; beside it the same split into two processes
    (`launch.colocate=false`, the placement this row measured before colocation);
(c) separate cores, as separate GPUs would be (explorer pinned to core 0, trainer to core
    1): sync (`offset 0`) against 64 / (t_gen + t_train), async (`offset 1`) against
    64 / max(t_gen, t_train), both on one core;
(d) a long tail: one task in eight waits `10 x t_gen` in its reward (an environment delay,
    tools/bench/pipeline_reward.py), with the cores separate as in (c), in the default
    config (reward workers adaptive, steps in flight derived from the offset): completions/s
    sync (`offset 0`) against async with only `sync.offset` set (so that the steps in flight
    cover a step's latency, `delay + t_gen`, plus a backlog of `TAIL_BACKLOG` committed
    steps), and the trainer's busy fraction (its step time not spent waiting for data);
    beside it the same tuned by hand (the reward workers a step's slow groups need); and
    the same wait in an `async def` environment instead of the reward, on one trajectory in
    eight (the multi-turn workflow with one turn, tools/bench/pipeline_env.py), sync against
    async with only `sync.offset` set;

A loop's rate is taken from the trainer's metrics between its 3rd and last step (start-up,
the first weights and the first batch left out). Under each loop it prints where a step's
time goes: the medians of the trainer's step, training, publishing (`sync_seconds`) and
waiting for data, and of the explorer's step, generating, scoring and waiting for weights.
Targets (issues 15, 32, 35): (b) colocated >= 0.9, (c) sync >= 0.9 and async >= 0.85, (d) in the
default config async / sync >= 2.5 with busy >= 0.9. Needs 2+ cores. `--parts d` runs (a)'s
one-core timings and (d) only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.bench.pipeline_timings import REPEAT, TASKS, measure  # noqa: E402  (after the path)

BATCH, TOKENS = TASKS * REPEAT, 5
WARM = 2  # trainer steps left out of a loop's rate
IDLE = 0.1  # seconds a role sleeps between its steps when roles take turns (diagnostic)
REWARD = "tools.bench.pipeline_reward:delayed"
ENV = "tools.bench.pipeline_env:DelayedAnswer"
TAIL_BACKLOG = 4  # (d): committed steps the async trainer may have in hand, past the delay


def config_text(root: Path, model: Path, steps: int, tokens: int = TOKENS) -> str:
    """The bench run's config: the demo's GRPO stage alone, one explorer, no evaluation."""
    return f"""
run: {{name: bench, root: {root}, seed: 0}}
model: {{path: {model}}}
tasks: {{type: arithmetic, digits: 2, ops: "+", eval_size: 8}}
explorer: {{count: 1, tasks_per_step: {TASKS}, repeat: {REPEAT}, temperature: 1.0,
           max_new_tokens: {tokens}}}
algorithm: {{algorithm_type: grpo}}
trainer: {{lr: 1.0e-5, batch_size: {BATCH}, steps: {steps}, save_interval: 100000}}
sync: {{method: checkpoint, interval: 1, offset: 0}}
eval: {{interval: 0}}
"""


# --- (b)-(d): whole loops through rft-hpc run ----------------------------------------------

def run_loop(work: Path, name: str, config_path: Path, *sets: str) -> dict:
    """`rft-hpc run` of the bench config with `--set`s; the trainer's rate after warm-up:
    completions/s, the trainer's busy fraction, wall seconds of the measured steps."""
    from rft_hpc.monitor.metrics import read_metrics

    root = work / name
    args = [a for s in (f"run.root={root}", *sets) for a in ("--set", s)]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rft_hpc.cli", "run", str(config_path),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{name}: rft-hpc run failed\n{proc.stderr[-3000:]}")
    rows = [r for r in read_metrics(next(root.glob("**/metrics/trainer.jsonl")))
            if "train_seconds" in r]
    rows = rows[WARM:]
    wall = rows[-1]["time"] - rows[0]["time"]
    steps = rows[1:]  # each of these ends `seconds` after the one before
    busy = sum(r["seconds"] - r.get("wait_seconds", 0.0) for r in steps) / \
        sum(r["seconds"] for r in steps)
    explorer = read_metrics(next(root.glob("**/metrics/explorer-0.jsonl")))[WARM + 1:]
    return {"completions_per_s": len(steps) * BATCH / wall, "busy": busy, "wall_s": wall,
            "reward_workers": max((r.get("reward_workers", 0) for r in explorer), default=0),
            "total_s": time.perf_counter() - t0,
            "trainer_ms": medians_ms(steps, ("seconds", "train_seconds", "sync_seconds",
                                             "wait_seconds")),
            "explorer_ms": medians_ms(explorer, ("seconds", "generate_seconds",
                                                 "reward_seconds", "wait_seconds"))}


def medians_ms(rows: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    """Each key's median over the rows that have it, in milliseconds: where a loop's step
    time goes (a role's step `seconds` = its work + publishing or committing + waiting)."""
    return {k: round(statistics.median(r[k] for r in rows if k in r) * 1e3, 1)
            for k in keys if any(k in r for r in rows)}


def bench(work: Path, steps: int, tokens: int = TOKENS, parts: str = "abcd") -> dict:
    """Every figure of the module doc (of `parts`), with its limit and ratio."""
    from rft_hpc.models.tiny import init_tiny_model

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("the pipeline bench needs at least 2 cores")
    model = init_tiny_model(work / "model")
    config_path = work / "bench.yaml"
    config_path.write_text(config_text(work / "runs", model, steps, tokens))
    one, other = [cores[0]], [cores[1]]
    t = {"gen_1": measure("gen", config_path, one), "train_1": measure("train", config_path, one)}
    out: dict = {"cores": len(cores), "t": t, "tokens": tokens}
    pinned = (f"explorer.cpus=[{one[0]}]", f"trainer.cpus=[{other[0]}]")
    if set(parts) & set("bc"):
        t.update(gen_all=measure("gen", config_path, cores),
                 train_all=measure("train", config_path, cores),
                 gen_1_idle=measure("gen", config_path, one, idle=IDLE),
                 train_1_idle=measure("train", config_path, one, idle=IDLE),
                 loop_all=measure("loop", config_path, cores),
                 loop_1=measure("loop", config_path, one),
                 colocated_all=measure("colocated", config_path, cores))
        limit_b = BATCH / (t["gen_all"] + t["train_all"])
        colocated = run_loop(work, "colocated", config_path)  # the default placement
        out["b_colocated"] = {**colocated, "limit": limit_b,
                              "ratio": colocated["completions_per_s"] / limit_b}
        shared = run_loop(work, "shared", config_path, "launch.colocate=false")
        out["b_shared"] = {**shared, "limit": limit_b,
                           "ratio": shared["completions_per_s"] / limit_b}
        sync = run_loop(work, "sync", config_path, *pinned)
        limit_sync = BATCH / (t["gen_1"] + t["train_1"])
        out["c_sync"] = {**sync, "limit": limit_sync,
                         "ratio": sync["completions_per_s"] / limit_sync}
        async_ = run_loop(work, "async", config_path, *pinned, "sync.offset=1")
        limit_async = BATCH / max(t["gen_1"], t["train_1"])
        out["c_async"] = {**async_, "limit": limit_async,
                          "ratio": async_["completions_per_s"] / limit_async}
    if "d" not in parts:
        return out
    delay = 10 * t["gen_1"]
    step_s = max(t["gen_1"], t["train_1"])
    # a step is committed `delay + t_gen` after it is submitted: the steps in flight must
    # cover that, and the trainer keeps a backlog of committed steps for the explorer's
    # bursts (the engine generates the steps submitted together in one batch)
    ahead = math.ceil((delay + t["gen_1"]) / step_s) + TAIL_BACKLOG
    workers = REPEAT * (math.ceil(delay / step_s) + 1)  # slow groups pending at once, x 8
    tail = (f"tasks.reward={{name: {REWARD}, args: {{delay: {delay:.4f}}}}}",
            f"explorer.reward_timeout={delay * 5 + 10}")
    tail_sync = run_loop(work, "tail_sync", config_path, *pinned, *tail)
    # the default config: only the offset set (reward workers and steps in flight derived)
    tail_async = run_loop(work, "tail_async", config_path, *pinned, *tail,
                          f"sync.offset={ahead - 1}")
    tail_tuned = run_loop(work, "tail_tuned", config_path, *pinned, *tail,
                          f"sync.offset={ahead - 1}", f"explorer.steps_in_flight={ahead}",
                          f"explorer.reward_workers={workers}")
    env = (f"explorer.workflow={{type: multi_turn, env: {ENV}, env_args: {{delay: "
           f"{delay:.4f}}}, max_turns: 1, max_timeout: {delay * 5 + 10}}}",)
    env_sync = run_loop(work, "env_sync", config_path, *pinned, *env)
    env_async = run_loop(work, "env_async", config_path, *pinned, *env,
                         f"sync.offset={ahead - 1}")
    out["d_env"] = {"sync": env_sync, "async": env_async, "busy": env_async["busy"],
                    "ratio": env_async["completions_per_s"] / env_sync["completions_per_s"]}
    out["d_tail"] = {"delay_s": delay, "offset": ahead - 1, "reward_workers": workers,
                     "sync": tail_sync, "async": tail_async, "tuned": tail_tuned,
                     "ratio": tail_async["completions_per_s"] / tail_sync["completions_per_s"],
                     "busy": tail_async["busy"],
                     "tuned_ratio": tail_tuned["completions_per_s"]
                     / tail_sync["completions_per_s"]}
    return out


def report(r: dict) -> None:
    """Print the figures, their limits, ratios and targets."""
    t = r["t"]
    if "b_shared" not in r:
        print(f"(a) t_gen {t['gen_1'] * 1e3:.1f} ms, t_train {t['train_1'] * 1e3:.1f} ms on 1 "
              "core")
    else:
        report_bc(r)
    if "d_tail" in r:
        report_d(r)


def report_bc(r: dict) -> None:
    """Print (a)-(c)."""
    t = r["t"]
    print(f"(a) t_gen {t['gen_1'] * 1e3:.1f} ms on 1 core, {t['gen_all'] * 1e3:.1f} ms on "
          f"{r['cores']}; t_train {t['train_1'] * 1e3:.1f} ms on 1 core, "
          f"{t['train_all'] * 1e3:.1f} ms on {r['cores']} (one step: {TASKS} x {REPEAT} x "
          f"{r['tokens']} tokens, batch {BATCH})")
    cold = t["gen_1_idle"] + t["train_1_idle"]
    print(f"    after {IDLE * 1e3:.0f} ms idle, as each role runs when they take turns: t_gen "
          f"{t['gen_1_idle'] * 1e3:.1f} ms, t_train {t['train_1_idle'] * 1e3:.1f} ms on 1 "
          f"core; a sync loop with no overhead at all would reach "
          f"{(t['gen_1'] + t['train_1']) / cold:.3f} of (c)'s sync limit")
    print(f"    one process alternating them (generate, then train on it: no second process, "
          f"no sync, no files): {t['loop_all'] * 1e3:.1f} ms a step on {r['cores']} cores, "
          f"{t['loop_1'] * 1e3:.1f} ms on 1: the most any loop can reach is "
          f"{(t['gen_all'] + t['train_all']) / t['loop_all']:.3f} of (b)'s limit and "
          f"{(t['gen_1'] + t['train_1']) / t['loop_1']:.3f} of (c)'s sync limit")
    print(f"    the two colocated loops with nothing else (explorer thread, trainer thread, one "
          f"device thread, the in-memory handover; no buffer, ledger, metrics, heartbeats or "
          f"logs): {t['colocated_all'] * 1e3:.1f} ms a step on {r['cores']} cores: "
          f"{(t['gen_all'] + t['train_all']) / t['colocated_all']:.3f} of (b)'s limit")
    rows = [("(b) shared cores, default config", r["b_colocated"], 0.9,
             "64/(t_gen+t_train), all"),
            ("(b) shared, split (colocate=false)", r["b_shared"], 0.9,
             "64/(t_gen+t_train), all"),
            ("(c) separate cores, sync", r["c_sync"], 0.9, "64/(t_gen+t_train), 1 core"),
            ("(c) separate cores, async", r["c_async"], 0.85, "64/max(t_gen,t_train), 1 core")]
    for label, x, target, limit in rows:
        print(f"{label:34} {x['completions_per_s']:7.1f} completions/s, limit "
              f"{x['limit']:7.1f} ({limit}): ratio {x['ratio']:.3f} (target >= {target}) "
              f"{'ok' if x['ratio'] >= target else 'MISSED'}")
        print(f"{'':34} step medians, ms: trainer {x['trainer_ms']}, explorer "
              f"{x['explorer_ms']}")


def report_d(r: dict) -> None:
    """Print (d)."""
    d = r["d_tail"]
    print(f"(d) long tail (1 task in 8 waits {d['delay_s'] * 1e3:.0f} ms), defaults "
          f"(reward workers adaptive): sync {d['sync']['completions_per_s']:.1f}, async "
          f"(only sync.offset {d['offset']} set) {d['async']['completions_per_s']:.1f} "
          f"completions/s: async/sync {d['ratio']:.2f} (target >= 2.5) "
          f"{'ok' if d['ratio'] >= 2.5 else 'MISSED'}; trainer busy {d['busy']:.3f} "
          f"(target >= 0.9) {'ok' if d['busy'] >= 0.9 else 'MISSED'}; reward workers at "
          f"most {d['sync']['reward_workers']:.0f} (sync), {d['async']['reward_workers']:.0f}"
          " (async)")
    print(f"    tuned beside it ({d['reward_workers']} reward workers set by hand, steps in "
          f"flight {d['offset'] + 1}): {d['tuned']['completions_per_s']:.1f} completions/s, "
          f"async/sync {d['tuned_ratio']:.2f}, trainer busy {d['tuned']['busy']:.3f}")
    for label, x in (("sync", d["sync"]), ("async", d["async"]), ("tuned", d["tuned"])):
        print(f"    {label:5} step medians, ms: trainer {x['trainer_ms']}, explorer "
              f"{x['explorer_ms']}")
    e = r["d_env"]
    print(f"(d) the same wait in an async def environment (multi-turn workflow, one turn; one "
          f"trajectory in 8 waits), defaults: sync {e['sync']['completions_per_s']:.1f}, "
          f"async (only sync.offset {d['offset']} set) {e['async']['completions_per_s']:.1f} "
          f"completions/s: async/sync {e['ratio']:.2f} (target >= 2.5) "
          f"{'ok' if e['ratio'] >= 2.5 else 'MISSED'}; trainer busy {e['busy']:.3f} (target "
          f">= 0.9) {'ok' if e['busy'] >= 0.9 else 'MISSED'}")
    for label, x in (("sync", e["sync"]), ("async", e["async"])):
        print(f"    {label:5} step medians, ms: trainer {x['trainer_ms']}, explorer "
              f"{x['explorer_ms']}")


def main() -> int:
    """Run the bench."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="trainer steps per loop [16]")
    ap.add_argument("--runs", type=int, default=1, help="whole benches, one after another")
    ap.add_argument("--tokens", type=int, default=TOKENS,
                    help=f"tokens per rollout [{TOKENS}, the demo's]: longer steps show which "
                         "costs are per step")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--parts", default="abcd", help="which loops to run [abcd]; (a) always")
    args = ap.parse_args()
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="rft-bench-pipeline-") as tmp:
            r = bench(Path(tmp), args.steps, args.tokens, args.parts)
        if args.runs > 1:
            print(f"--- run {i + 1} of {args.runs}")
        report(r)
        results.append(r)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
