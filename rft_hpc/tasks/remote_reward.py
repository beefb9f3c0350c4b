"""The explorer's side of the reward job (docs/reward-job.md): a reward `Scorer` for
reward-model and LLM-judge terms that sends each batch to the explorer's reward job as a
request file and takes in the response when it comes.

While it waits, nothing blocks: `pump` looks for responses (at most every `POLL_SECONDS`,
sooner when the kernel says the folder changed) and the explorer goes on generating. A
reward job that is restarted (crash, SIGKILL, requeue) answers the requests still without
a response when it is back, so the explorer just waits for it; one that is gone for good
(`RewardJobWatch.gone`) fails the explorer with a message saying so, instead of a hang or
rewards of 0.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from rft_hpc.core.rundir import RunDir, make_dirs, read_json
from rft_hpc.core.watch import FolderWatch
from rft_hpc.tasks.reward_pool import RewardCall, Scoring
from rft_hpc.tasks.reward_requests import (
    job_folder,
    new_incarnation,
    read_response,
    remove_explorer_files,
    remove_request,
    request_id,
    reward_role,
    serving_job,
    write_request,
)

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
"""How often a waiting explorer looks for its responses (one stat per request waiting):
far below a step's time, and few metadata operations on a parallel filesystem."""

LIVENESS_SECONDS = 30.0
"""How often an explorer whose oldest request has waited this long asks whether its reward
job is still there (a `squeue` call under Slurm: a few per second over hundreds of
explorers at most)."""

LOCAL_RESTART_SECONDS = 60.0
"""How long a local reward process found dead may take to be started again by `rft-hpc
run` (a requeue exit is restarted within a second) before the explorer gives up."""


class RewardJobGone(RuntimeError):
    """The explorer's reward job ended or failed for good while requests waited for it."""


class RewardJobWatch(Protocol):
    """Tells whether a reward job is gone for good."""

    def gone(self) -> str | None:
        """Why the reward job will never answer (ended, failed, dead and not restarting);
        None while it runs, waits in the queue or may be restarted."""
        ...


class HeartbeatWatch:
    """`RewardJobWatch` from the reward job's heartbeat (`state/reward-<j>.json`): done
    means gone; under Slurm its job (the heartbeat's, else the run's `state/jobs.json`)
    must still be in `squeue` (pending, running, requeued); locally its process must live,
    or be started again within `LOCAL_RESTART_SECONDS`."""

    def __init__(self, stage: Path, job: int, *,
                 restart_seconds: float = LOCAL_RESTART_SECONDS) -> None:
        self.run, self.job = RunDir(stage), job
        self.role = reward_role(job)
        self.restart_seconds = restart_seconds
        """How long a dead local process may take to come back (tests shorten it)."""
        self._dead_since: float | None = None

    def gone(self) -> str | None:
        """Why the reward job is gone for good, or None (see the class)."""
        try:
            beat = read_json(self.run.heartbeat(self.role))
        except (OSError, ValueError):
            beat = {}
        if beat.get("status") == "done":
            return f"{self.role} has finished"
        slurm_job = beat.get("job") or self._submitted_job()
        if slurm_job:
            return self._in_queue(str(slurm_job))
        pid = beat.get("pid")
        if not pid or beat.get("host") != socket.gethostname():
            return None  # not started yet, or elsewhere without Slurm: nothing to ask
        if _alive(int(pid)):
            self._dead_since = None
            return None
        now = time.monotonic()
        self._dead_since = self._dead_since or now
        if now - self._dead_since < self.restart_seconds:
            return None
        return (f"{self.role}'s process {pid} died and was not started again within "
                f"{self.restart_seconds:g} s")

    def _submitted_job(self) -> str | None:
        """`<array id>_<j>` of the stage's reward array in the run's last submission."""
        try:
            subs = read_json(self.run.root.parent.parent / "state" / "jobs.json")["submissions"]
        except (OSError, ValueError, KeyError):
            return None
        stage = self.run.root.name.split("-", 1)[-1]
        ids = [j["id"] for j in subs[-1]["jobs"] if j.get("name") == f"{stage}.reward"]
        return f"{ids[-1]}_{self.job}" if ids else None

    def _in_queue(self, slurm_job: str) -> str | None:
        try:
            result = subprocess.run(["squeue", "--noheader", "--format=%T", f"--jobs={slurm_job}"],
                                    capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("cannot ask squeue about %s (job %s): %s", self.role, slurm_job, exc)
            return None
        if result.returncode == 0 and result.stdout.split():
            return None
        if result.returncode == 0 or "Invalid job id" in result.stderr:
            return f"{self.role}'s Slurm job {slurm_job} is no longer queued or running"
        log.warning("squeue about %s (job %s) failed: %s", self.role, slurm_job,
                    result.stderr.strip())
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or no /proc: taken as alive
        return True


class RemoteModelScorer:
    """Scores reward-model and judge calls in explorer `explorer`'s reward job (one of
    `count`): a `Scorer` (`explorer.protocols`) with the promises of any, each outcome
    naming its request and place there (`RewardOutcome.request`). At start it removes its
    explorer's earlier processes' requests and responses."""

    def __init__(self, stage: Path, explorer: int, count: int,
                 watch: RewardJobWatch | None = None, *,
                 liveness_seconds: float = LIVENESS_SECONDS) -> None:
        self.explorer, self.job = explorer, serving_job(explorer, count)
        self.folder = job_folder(stage, self.job)
        make_dirs(self.folder)
        removed = remove_explorer_files(self.folder, explorer)
        if removed:
            log.info("removed %d reward request/response files of earlier processes", removed)
        self.watch = watch or HeartbeatWatch(stage, self.job)
        self.liveness_seconds = liveness_seconds
        """How long a request waits before the reward job is asked after (tests shorten it)."""
        self.incarnation = new_incarnation()
        self._number = 0
        self._outbox: list[Scoring] = []
        """Calls submitted since the last `pump`: sent together, as one request."""
        self._waiting: dict[str, tuple[list[Scoring], float]] = {}
        """Request id -> (the Scorings its calls came in, in order; when it was sent:
        monotonic)."""
        self._looked = self._asked = 0.0
        self._changes = FolderWatch(self.folder)

    @property
    def size(self) -> int:
        """Reward models loaded here: none (they are in the reward job)."""
        return 0

    @property
    def busy(self) -> bool:
        """Whether calls wait for work in this process: never (the reward job works)."""
        return False

    def submit(self, calls: Sequence[RewardCall]) -> Scoring:
        """Queue `calls` for the reward job and return their `Scoring`; `pump` sends every
        call queued since the last one as one request (the groups an engine step finished
        reach the reward job together: its forwards are fuller)."""
        scoring = Scoring(calls)
        if scoring.calls:
            self._outbox.append(scoring)
        return scoring

    def _send(self) -> None:
        """Send the queued calls as one request."""
        if not self._outbox:
            return
        rid = request_id(self.explorer, self.incarnation, self._number)
        self._number += 1
        write_request(self.folder, rid, self.explorer,
                      [call for scoring in self._outbox for call in scoring.calls])
        self._waiting[rid] = (self._outbox, time.monotonic())
        self._outbox = []

    def pump(self, timeout: float | None = 0.0) -> None:
        """Send the queued calls, then take in the responses there are, waiting up to
        `timeout` seconds (None: until one comes) while requests wait. Raises
        `RewardJobGone` when the reward job is gone for good with requests waiting."""
        self._send()
        end = None if timeout is None else time.monotonic() + timeout
        woke = self._changes.wait(0.0)  # the folder changed since the last look
        while self._waiting:
            now = time.monotonic()
            if woke or now - self._looked >= POLL_SECONDS:
                self._looked = now
                if self._take_responses():
                    return
                self._check_alive(now)
            left = POLL_SECONDS if end is None else min(POLL_SECONDS, end - now)
            if left <= 0:
                return
            woke = self._changes.wait(left)

    def _take_responses(self) -> bool:
        """Put the outcomes of every answered request; whether there was one."""
        took = False
        for rid, (scorings, _) in list(self._waiting.items()):
            outcomes = read_response(self.folder, rid)
            if outcomes is None:
                continue
            calls = sum(len(scoring.calls) for scoring in scorings)
            if len(outcomes) != calls:
                raise RuntimeError(f"{self.folder / rid}: {len(outcomes)} outcomes for "
                                   f"{calls} calls")
            index = 0
            for scoring in scorings:
                for i in range(len(scoring.calls)):
                    scoring.put(i, replace(outcomes[index], request=f"{rid}/{index}"))
                    index += 1
            remove_request(self.folder, rid)
            del self._waiting[rid]
            took = True
        return took

    def _check_alive(self, now: float) -> None:
        oldest = min(sent for _, sent in self._waiting.values())
        every = self.liveness_seconds
        if now - oldest < every or now - self._asked < every:
            return
        self._asked = now
        why = self.watch.gone()
        if why is not None:
            raise RewardJobGone(
                f"{len(self._waiting)} reward request(s) of explorer {self.explorer} wait for "
                f"{reward_role(self.job)} in {self.folder}, but {why}: see its log "
                f"(jobs/{reward_role(self.job)}.log); `rft-hpc resume` (Slurm) or running "
                "the same `rft-hpc run` again brings it back")

    def close(self) -> None:
        """Withdraw the requests still waiting and stop watching the folder."""
        self._outbox.clear()
        for rid in list(self._waiting):
            remove_request(self.folder, rid)
        self._waiting.clear()
        self._changes.close()
