"""The reward job role (docs/reward-job.md): reward job `j` of a stage scores the
reward-model and LLM-judge calls that its explorers (`i % count == j`) send as request
files, in batched passes across explorers (`tasks.model_reward.ModelScorer`,
`tasks.judge_reward.JudgeScorer`, judges on vLLM too), and answers each request with a
response file, until every explorer it serves is done.

Like every role it beats a heartbeat (`state/reward-<j>.json`, with its Slurm job and host so
that waiting explorers can tell whether it is still there), stops at a safe point on a stop
signal (Slurm's warning: it requeues itself), logs to `jobs/reward-<j>.log`, writes metrics
(`metrics/reward-<j>.jsonl`, one line per scored round) and a ledger
(`ledger/reward-<j>.jsonl`: start, one `scored` event per request, stop). It holds no state
of its own: a restarted reward job scores every request without a response.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import RunDir, make_dirs
from rft_hpc.core.storage import close_all
from rft_hpc.core.watch import FolderWatch
from rft_hpc.engines.judge import judge_loaders
from rft_hpc.ledger.log import LedgerWriter
from rft_hpc.monitor.metrics import MetricsWriter
from rft_hpc.runtime.common import (
    StopFlag,
    load_stage,
    read_heartbeat,
    set_threads,
    write_heartbeat,
)
from rft_hpc.runtime.lifecycle import JobClock
from rft_hpc.runtime.logs import setup_logging
from rft_hpc.tasks.model_reward import engine_device
from rft_hpc.tasks.reward_mix import local_scorers
from rft_hpc.tasks.reward_pool import RewardOutcome, Scoring
from rft_hpc.tasks.reward_requests import (
    Request,
    job_folder,
    read_request,
    remove_orphan_responses,
    reward_role,
    served_explorers,
    unanswered,
    write_response,
)

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
"""How often an idle reward job lists its folder for requests when nothing woke it (on one
node the kernel wakes it at once): a tenth of a second against steps of seconds."""

HEARTBEAT_SECONDS = 2.0
"""How often an idle reward job replaces its heartbeat, and reads its explorers' ones to
tell whether they are all done."""


def slurm_job() -> str | None:
    """This process's Slurm job as squeue names it (`<array>_<task>` in an array), or None
    outside Slurm."""
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def explorers_done(run: RunDir, explorers: list[int]) -> bool:
    """Whether every explorer of `explorers` has finished for good: its heartbeat says done
    and it is not waiting to replace stale drops."""
    for i in explorers:
        beat = read_heartbeat(run, f"explorer-{i}")
        if beat.get("status") != "done" or beat.get("replacing_drops"):
            return False
    return True


class RewardJob:
    """Reward job `index` of a stage: its folder, scorer, ledger, metrics and heartbeat."""

    def __init__(self, config: ExperimentConfig, run: RunDir, index: int,
                 stop: StopFlag) -> None:
        self.run, self.index, self.stop = run, index, stop
        self.role = reward_role(index)
        self.explorers = served_explorers(index, config.reward_job.count,
                                          config.explorer.count)
        self.folder = job_folder(run.root, index)
        make_dirs(self.folder)
        self.scorers = local_scorers(engine_device(), judge_loaders=judge_loaders())
        """The scorer of each kind of term a request may carry (`model`, `judge`)."""
        self.ledger = LedgerWriter(run.ledger, self.role, durable=False)
        # nothing to resume: a reward job's only work is the requests without a response
        self.ledger.append("start", resume_step=0, first_redone=0, pid=os.getpid(),
                           job=slurm_job(),
                           slurm_restarts=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
        self.metrics = MetricsWriter(run.metrics, self.role)
        self.clock = JobClock(config.launch.slurm.walltime_margin)
        self.requests = self.calls = self.rounds = 0
        self.started = time.time()
        self._beaten = 0.0

    def serve(self) -> bool:
        """Score requests until every served explorer is done (True) or a stop (False)."""
        watch = FolderWatch(self.folder)
        try:
            while not self.stop:
                todo = unanswered(self.folder)
                if todo:
                    self.score(todo)
                    continue
                if time.monotonic() - self._beaten >= HEARTBEAT_SECONDS:
                    if explorers_done(self.run, self.explorers) \
                            and not unanswered(self.folder):
                        return True
                    self.beat("running")
                if not self.clock.next_step_fits():
                    self.stop.out_of_time()
                self.stop.sleep(POLL_SECONDS, watch)
            return False
        finally:
            watch.close()

    def score(self, paths: list[Path]) -> None:
        """Score the requests at `paths` together (batched forwards across explorers),
        record each in the ledger (synced), then answer each that is still there."""
        t0 = time.monotonic()
        batches: list[tuple[Request, list[tuple[list[int], Scoring]]]] = []
        for path in paths:
            request = read_request(path)
            if request is not None:  # else its explorer restarted since the listing
                batches.append((request, self.submit(request)))
        for scorer in self.scorers.values():
            scorer.pump()
        for request, _ in batches:
            self.ledger.append("scored", request=request.id, explorer=request.explorer,
                               calls=len(request.calls))
        self.ledger.sync()  # the ledger holds every request before its answer exists
        for request, parts in batches:
            if (self.folder / f"{request.id}.req").exists():
                outcomes: list[RewardOutcome] = [RewardOutcome()] * len(request.calls)
                for indices, scoring in parts:
                    for i, outcome in zip(indices, scoring.result(), strict=True):
                        outcomes[i] = outcome
                write_response(self.folder, request.id, outcomes)
        seconds = time.monotonic() - t0
        self.clock.observe_step(seconds)
        calls = sum(len(r.calls) for r, _ in batches)
        self.requests += len(batches)
        self.calls += calls
        self.metrics.log(self.rounds, {"requests": len(batches), "calls": calls,
                                       "explorers": len({r.explorer for r, _ in batches}),
                                       "seconds": seconds})
        self.rounds += 1
        log.debug("scored %d requests (%d calls) in %.3f s", len(batches), calls, seconds)
        self.beat("running")

    def submit(self, request: Request) -> list[tuple[list[int], Scoring]]:
        """Queue `request`'s calls with the scorer of each one's kind (a request may hold
        both reward-model and judge calls): (the calls' places in the request, their
        Scoring) per kind."""
        places: dict[str, list[int]] = {}
        for index, (task, _) in enumerate(request.calls):
            places.setdefault(task.reward_terms[0].kind, []).append(index)
        return [(indices, self.scorers[kind].submit([request.calls[i] for i in indices]))
                for kind, indices in places.items()]

    def beat(self, status: str) -> None:
        """Replace the heartbeat: requests scored, and where this process runs."""
        write_heartbeat(self.run, self.role, status=status, step=self.requests,
                        calls=self.calls, started=self.started, start_step=0, job=slurm_job(),
                        host=socket.gethostname(), explorers=self.explorers)
        self._beaten = time.monotonic()

    def close(self, reason: str) -> None:
        """Record why it ended (ledger, heartbeat) and free the models."""
        if reason == "done":  # every explorer is done: no one reads a response any more
            remove_orphan_responses(self.folder)
        self.ledger.append("stop", step=self.requests, reason=reason)
        close_all((self.ledger.close, self.metrics.close, self.release))
        self.beat("done" if reason == "done" else "stopped")

    def release(self) -> None:
        """Free the models (their scorers' threads and workers), writing nothing: what a
        job that failed (a full disk, say) still does before it exits."""
        close_all(scorer.close for scorer in self.scorers.values())


def run_reward_job(stage_dir: Path, index: int) -> int:
    """Run reward job `index` of a stage until every explorer it serves is done; returns the
    requests it scored. Stopped by Slurm's warning signal or its job's time limit, it raises
    `RequeueRequested` (the requests it did not answer wait for its next process)."""
    role = reward_role(index)
    setup_logging(role)
    config, run = load_stage(stage_dir)
    set_threads(None)  # logs how many and why
    stop = StopFlag()
    job = RewardJob(config, run, index, stop)
    log.info("serving explorers %s from %s", job.explorers, job.folder)
    done = False
    try:
        done = job.serve()
    finally:
        reason = "done" if done else stop.reason if stop else "crash"
        if reason != "crash":
            job.close(reason)
        else:
            job.release()
    log.info("%s after %d requests (%d calls)", "finished" if done else f"stopped ({reason})",
             job.requests, job.calls)
    if not done:
        stop.check_requeue()
    return job.requests
