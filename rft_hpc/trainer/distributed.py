"""Data-parallel trainer ranks: how they find each other and what they exchange.

The trainer job runs N processes (Slurm tasks launched by srun, or torchrun's workers). Rank
0 leads: it alone reads the buffer, publishes weights, evaluates, writes metrics, heartbeats
and checkpoints. Each step it splits the batch into one `Shard` per rank (GRPO advantages
already computed over the whole batch) and scatters them; every rank computes its part of the
global token-mean loss, the gradients are summed over the ranks, and every rank takes the
same optimizer step, so the replicas stay identical.

Where the ranks come from (`init_distributed`), first match wins:

- torchrun style: `WORLD_SIZE`, `RANK`, `LOCAL_RANK` (default `SLURM_LOCALID`, else 0);
- Slurm tasks: submitit's `JobEnvironment` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`;
  `SLURM_STEP_NUM_TASKS` first when set), used only when a rendezvous is given (below), so
  a single process inside a many-task allocation stays a single process;
- otherwise (or a world of 1): one process, no process group; the trainer behaves exactly
  as a plain single-process trainer.

Rendezvous: `RFT_DIST_INIT_FILE`, a file path on the shared filesystem (`init_method=file://`:
no host names, which need not resolve on every cluster; a fresh file per job, suffixed with
`SLURM_RESTART_COUNT` after a requeue so a killed attempt's stale file is never reused); else
`MASTER_ADDR`/`MASTER_PORT` (`env://`). Backend: nccl when CUDA is available, else gloo;
`RFT_DIST_BACKEND` overrides it. Pickled objects (control messages, shards) always travel
over gloo on the CPU; gradients over the main backend. `RFT_DIST_TIMEOUT` (seconds, default
1800) bounds every collective: a rank never waits longer than that for a silent peer, and a
peer that exits closes its connections, which fails the others' pending collectives at once.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rft_hpc.algorithms.aggregation import LossNorm
from rft_hpc.buffer.reader import Batch
from rft_hpc.buffer.records import Record

ENV_INIT_FILE = "RFT_DIST_INIT_FILE"
ENV_BACKEND = "RFT_DIST_BACKEND"
ENV_TIMEOUT = "RFT_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0
BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class DistContext:
    """This process's place among the trainer ranks (defaults: a single process on CPU;
    `init_distributed` gives a single process the GPU of its local rank when there is one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    """`gloo` or `nccl`; None when there is no process group (world size 1)."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds any collective may wait for the other ranks."""

    @property
    def distributed(self) -> bool:
        """True when there are several ranks."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that reads the buffer and writes the run directory."""
        return self.rank == 0


@dataclass(frozen=True)
class Launch:
    """Rank, world and rendezvous read from the environment."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str | None


_context: DistContext | None = None
_control: dist.ProcessGroup | None = None  # gloo group for pickled objects (None: default)
_owned = False  # whether init_distributed created the default process group


def launch_from_env(env: Mapping[str, str] | None = None) -> Launch:
    """Where this process stands, from torchrun's or Slurm's variables (see the module doc)."""
    env = os.environ if env is None else env
    init_method = _init_method(env)
    local = env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    if "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        if "RANK" not in env and world > 1:
            raise ValueError(f"WORLD_SIZE is {world} but RANK is not set")
        rank = int(env.get("RANK", "0"))
    elif "SLURM_PROCID" in env and init_method is not None:
        rank, world, local = _slurm_task(env)
    else:
        return Launch(0, 1, 0, None)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not within a world of {world}")
    if world > 1 and init_method is None:
        raise ValueError(f"{world} trainer ranks but no rendezvous: set {ENV_INIT_FILE} (a file "
                         "on the shared filesystem) or MASTER_ADDR and MASTER_PORT")
    return Launch(rank, world, int(local), init_method)


def _slurm_task(env: Mapping[str, str]) -> tuple[int, int, str]:
    """(rank, world size, local rank) of this Slurm task: from submitit's JobEnvironment
    for the process's own environment; from the same variables of a given mapping."""
    if env is os.environ:
        from submitit.slurm.slurm import SlurmJobEnvironment

        # Our sbatch scripts run the role, not submitit's pickled function, so
        # SUBMITIT_EXECUTOR is unset and submitit.JobEnvironment() could not pick Slurm.
        job = SlurmJobEnvironment()
        world = int(env.get("SLURM_STEP_NUM_TASKS", job.num_tasks))
        return job.global_rank, world, str(job.local_rank)
    world = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    return int(env["SLURM_PROCID"]), world, env.get("SLURM_LOCALID", "0")


def _init_method(env: Mapping[str, str]) -> str | None:
    path = env.get(ENV_INIT_FILE)
    if path:
        restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        if restarts:
            path = f"{path}.r{restarts}"
        return "file://" + str(Path(path).resolve())
    if env.get("MASTER_ADDR"):
        if not env.get("MASTER_PORT"):
            raise ValueError("MASTER_ADDR is set but MASTER_PORT is not")
        return "env://"
    return None


def init_distributed() -> DistContext:
    """Join the trainer's process group (once; later calls return the same context).

    A world of one creates no process group. An already initialized default group (made
    by the caller) is adopted as it is and left to the caller to destroy.
    """
    global _context, _control, _owned
    if _context is not None:
        return _context
    timeout = float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT))
    if dist.is_available() and dist.is_initialized():
        launch = Launch(dist.get_rank(), dist.get_world_size(),
                        int(os.environ.get("LOCAL_RANK", "0")), None)
        backend = str(dist.get_backend())
    else:
        launch = launch_from_env()
        if launch.world_size == 1:  # no process group; a GPU when there is one
            device = torch.device("cpu")
            if torch.cuda.is_available():
                device = torch.device("cuda", launch.local_rank)
                torch.cuda.set_device(device)
            _context = DistContext(device=device, timeout=timeout)
            return _context
        backend = os.environ.get(ENV_BACKEND) or ("nccl" if torch.cuda.is_available()
                                                  else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
    delta = datetime.timedelta(seconds=timeout)
    if not dist.is_initialized():
        if launch.init_method and launch.init_method.startswith("file://"):
            Path(launch.init_method[len("file://"):]).parent.mkdir(parents=True, exist_ok=True)
        dist.init_process_group(backend, init_method=launch.init_method, rank=launch.rank,
                                world_size=launch.world_size, timeout=delta)
        _owned = True
        if launch.rank == 0:  # the job log says how the ranks met (the file store's file is
            # removed once every rank has left)
            print(f"rft-hpc: trainer: {launch.world_size} ranks over {backend}, met through "
                  f"{launch.init_method or 'env://'}", file=sys.stderr, flush=True)
    _control = dist.new_group(backend="gloo", timeout=delta) if backend != "gloo" else None
    _context = DistContext(launch.rank, launch.world_size, launch.local_rank, device,
                           backend, timeout)
    return _context


def shutdown() -> None:
    """Leave the process group (no barrier: a rank that finished never waits for others)."""
    global _context, _control, _owned
    if _owned and dist.is_initialized():
        dist.destroy_process_group()
    _context, _control, _owned = None, None, False


# -- collectives ---------------------------------------------------------------------------

def broadcast_object(obj: object, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank (the others pass anything, e.g. None)."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def scatter_objects(objs: Sequence[Any] | None, ctx: DistContext) -> Any:
    """`objs[rank]` on each rank; rank 0 passes one object per rank, the others None."""
    if not ctx.distributed:
        assert objs is not None and len(objs) == 1
        return objs[0]
    if ctx.is_main and (objs is None or len(objs) != ctx.world_size):
        raise ValueError(f"rank 0 must scatter exactly {ctx.world_size} objects")
    out: list[Any] = [None]
    dist.scatter_object_list(out, list(objs) if ctx.is_main and objs else None, src=0,
                             group=_control)
    return out[0]


def all_gather_objects(obj: object, ctx: DistContext) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=_control)
    return out


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext, group: dist.ProcessGroup | None = None
                   ) -> torch.Tensor:
    """Sum `tensor` over the ranks (of `group`, default all), in place (on the rank's
    device); returns it."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def broadcast_parameters(module: torch.nn.Module, ctx: DistContext) -> None:
    """Copy rank 0's parameters and buffers into every rank's replica of `module`."""
    if not ctx.distributed:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], ctx: DistContext,
                         bucket_bytes: int = BUCKET_BYTES,
                         group: dist.ProcessGroup | None = None) -> None:
    """Replace every parameter's gradient by its sum over the ranks (of `group`, a process
    group every rank of which calls this; default all ranks).

    A parameter without a gradient on some rank counts as zeros there; one without a
    gradient on every rank keeps `grad = None` (the optimizer then skips it, as it would in
    a single process). Gradients travel flattened in buckets of about `bucket_bytes`.
    """
    if not ctx.distributed:
        return
    params = [p for p in params if p.requires_grad]
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                       device=ctx.device)
    all_reduce_sum(has, ctx, group)
    live = []
    for p, anywhere in zip(params, has.tolist(), strict=True):
        if not anywhere:
            p.grad = None
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        live.append(p)
    for bucket in _buckets(live, bucket_bytes):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        all_reduce_sum(flat, ctx, group)
        for p, part in zip(bucket, flat.split([p.numel() for p in bucket]), strict=True):
            p.grad.copy_(part.view_as(p.grad))


def _buckets(params: list[torch.nn.Parameter], limit: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device, about `limit` bytes per bucket."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = out[-1] if out else None
        if last is None or size + nbytes > limit or (last[0].dtype, last[0].device) != (
                p.dtype, p.device):
            out.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return out


# -- batch shards --------------------------------------------------------------------------

@dataclass
class Shard:
    """One rank's part of a batch, with what it needs to know about the whole batch."""

    records: list[Record]
    advantages: torch.Tensor | None
    """The advantages of this shard's rows, computed over the whole batch, times each
    record's sample weight: float32 [rows] (per sequence) or [rows, T] (per token, T the
    whole batch's padded length); None without advantages (SFT, DPO)."""
    num_tokens: int
    """Trained (loss) tokens in the whole batch: the divisor of the global token-mean."""
    num_records: int
    """Records in the whole batch."""
    dropped_stale: int = 0
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """Other per-row tensors computed over the whole batch (critic values, returns, ...),
    sliced like `advantages`."""
    norm: LossNorm | None = None
    """The whole batch's loss divisors (of its RL rows, for MIX)."""
    expert_norm: LossNorm | None = None
    """MIX: the whole batch's loss divisors of its expert rows."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of the whole batch computed before sharding (e.g. the mean reward)."""


def loss_tokens(records: Sequence[Record]) -> int:
    """Trained tokens of `records`: the sum of each response mask without its first entry
    (the first token is never predicted), as `collate(records).loss_mask.sum()` counts."""
    return sum(int(r.response_mask[1:].sum()) for r in records)


def shard_batch(batch: Batch, world_size: int, *, advantages: torch.Tensor | None,
                rows: dict[str, torch.Tensor] | None = None, rows_per_record: int = 1,
                num_tokens: int | None = None, norm: LossNorm | None = None,
                expert_norm: LossNorm | None = None,
                metrics: dict[str, float] | None = None) -> list[Shard]:
    """Split `batch` into `world_size` contiguous shards of (nearly) equal record counts.

    `advantages`: the whole batch's, one row per collated row (`rows_per_record` rows per
    record: 2 for DPO pairs), or None (SFT, DPO). They and the tensors of `rows` are sliced
    with the records; a shard may be empty when the batch has fewer records than there are
    ranks.
    `num_tokens` defaults to `loss_tokens(batch.records)`.
    """
    records = batch.records
    n = len(records)
    adv = advantages
    total = loss_tokens(records) if num_tokens is None else num_tokens
    bounds = [n * i // world_size for i in range(world_size + 1)]
    k = rows_per_record
    return [Shard(records=records[lo:hi],
                  advantages=None if adv is None else adv[lo * k:hi * k].clone(),
                  num_tokens=total, num_records=n, dropped_stale=batch.dropped_stale,
                  rows={name: t[lo * k:hi * k].clone() for name, t in (rows or {}).items()},
                  norm=norm, expert_norm=expert_norm, metrics=dict(metrics or {}))
            for lo, hi in itertools.pairwise(bounds)]
