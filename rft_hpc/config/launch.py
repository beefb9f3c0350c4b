"""The `launch` section: how `rft-hpc submit` turns the roles into Slurm jobs.

Each role gets its own Slurm settings (`launch.slurm.trainer`, ...). Secrets never go into
this section: a variable whose name looks like a key, token or password is refused in
`env` and `setup` (both are written into sbatch scripts and the frozen config); name it in
`pass_env` instead, and the job takes it from the environment `rft-hpc submit` runs in.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from rft_hpc.core.config_section import ConfigSection

_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|AUTH",
                          re.IGNORECASE)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=\S")
_MEMORY = re.compile(r"\d+[KMGT]?B?", re.IGNORECASE)
_TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}|\d+-\d+")
_UMASK = re.compile(r"0?[0-7]{3}")


def looks_secret(name: str) -> bool:
    """Whether an environment variable's name suggests a secret (key, token, password ...)."""
    return bool(_SECRET_NAME.search(name))




class ContainerConfig(ConfigSection):
    """An Apptainer/Singularity image that the role's command runs in."""

    image: str
    """Image file or URI (`/images/rft.sif`, `docker://...`); it must hold Python with
    rft-hpc installed."""

    runtime: Literal["apptainer", "singularity"] = "apptainer"
    """Container runtime command on the compute nodes."""

    binds: list[str] = Field(default_factory=list)
    """Extra `--bind` specifications (`/scratch`, `/data:/data:ro`); the run directory is
    always bound."""

    options: list[str] = Field(default_factory=list)
    """Further options of `<runtime> exec` (`--cleanenv`, ...); `--nv` is added when the job
    requests GPUs."""


class SlurmRoleConfig(ConfigSection):
    """Slurm settings of one role's jobs (each becomes an `#SBATCH` line when set)."""

    partition: str | None = None
    """Partition (`--partition`); null: the cluster's default partition."""

    account: str | None = None
    """Account charged for the jobs (`--account`)."""

    qos: str | None = None
    """Quality of service (`--qos`)."""

    nodes: int = Field(1, ge=1)
    """Nodes per job (`--nodes`). Explorers and helper jobs use one."""

    tasks_per_node: int = Field(1, ge=1)
    """Tasks (processes started by srun) per node (`--ntasks-per-node`); a trainer runs one
    rank per task. Explorers and helper jobs use one."""

    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node (`--gpus-per-node`); 0 requests none."""

    cpus_per_task: int | None = Field(None, ge=1)
    """CPUs per task (`--cpus-per-task`); null: the cluster's default."""

    mem: str | None = None
    """Memory per node (`--mem`), e.g. `8G` or `64000M`; null: the cluster's default."""

    time: str | None = None
    """Time limit (`--time`), e.g. `01:00:00`, `2-00:00:00` or minutes; null: the
    partition's default."""

    constraint: str | None = None
    """Node features required (`--constraint`), e.g. `a100`."""

    exclusive: bool = False
    """Whole nodes only (`--exclusive`)."""

    array_parallelism: int | None = Field(None, ge=1)
    """Arrays only (explorers, evaluators, reward jobs): at most this many array tasks run
    at once (`--array=0-N%P`)."""

    extra: dict[str, str] = Field(default_factory=dict)
    """Further sbatch options, as a mapping (`{reservation: big, requeue: true}`, written
    `--reservation=big`, `--requeue`) or as a list of long options (`["--reservation=big",
    "--requeue"]`)."""

    setup: list[str] = Field(default_factory=list)
    """Shell lines run before the role starts (`module load cuda/12`, `source
    /path/venv/bin/activate`)."""

    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables exported in the job script. Written into the script: never
    put secrets here (use `pass_env`)."""

    pass_env: list[str] = Field(default_factory=list)
    """Names of environment variables the jobs take from the environment of `rft-hpc
    submit` (`--export`), such as tracking-service keys; their values are never written."""

    container: ContainerConfig | None = None
    """Run the role's command inside this container image; null runs it on the host."""

    @field_validator("mem", "time", mode="before")
    @classmethod
    def _number_as_text(cls, value: object) -> object:
        # YAML reads `time: 30` and `mem: 8000` as numbers: Slurm takes them as minutes / MB.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("mem")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        if value is not None and not _MEMORY.fullmatch(value):
            raise ValueError("expected a size such as 8G, 512M or 64000 (megabytes)")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not _TIME.fullmatch(value):
            raise ValueError("expected a Slurm time such as 30, 01:00:00 or 2-00:00:00")
        return value

    @field_validator("env")
    @classmethod
    def _no_secrets_in_env(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if looks_secret(name):
                raise ValueError(
                    f"{name} looks like a secret and env is written into the sbatch script "
                    f"and the frozen config: list {name} in pass_env instead and export it "
                    "before `rft-hpc submit`")
        return env

    @field_validator("pass_env")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return names

    @field_validator("setup")
    @classmethod
    def _no_secrets_in_setup(cls, lines: list[str]) -> list[str]:
        for line in lines:
            for name in _ASSIGNMENT.findall(line):
                if looks_secret(name):
                    raise ValueError(
                        f"{line!r} sets {name}, which looks like a secret, in the sbatch "
                        f"script: list {name} in pass_env instead and export it before "
                        "`rft-hpc submit`")
        return lines

    @field_validator("extra", mode="before")
    @classmethod
    def _options(cls, extra: object) -> object:
        # Stored as option -> value, "" for a flag: `{requeue: true}` and `["--requeue"]` alike.
        if isinstance(extra, dict):
            return {k: "" if v is True else str(v) for k, v in extra.items() if v is not False}
        if not isinstance(extra, list):
            return extra
        options: dict[str, str] = {}
        for option in extra:
            if not isinstance(option, str) or not option.startswith("--"):
                raise ValueError(f"expected long sbatch options such as '--reservation=big', "
                                 f"got {option!r}")
            key, _, value = option[2:].partition("=")
            options[key] = value
        return options

    def tasks(self) -> int:
        """Tasks of one job: nodes x tasks per node."""
        return self.nodes * self.tasks_per_node


HELPER_DEFAULTS = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1,
                   "mem": None, "time": "00:30:00", "constraint": None, "exclusive": False,
                   "extra": {}}
"""Resources of the helper jobs unless `launch.slurm.helper` sets them."""


class SlurmConfig(ConfigSection):
    """Per-role Slurm settings and the jobs' warning signal."""

    explorer: SlurmRoleConfig = Field(default_factory=SlurmRoleConfig)
    """The explorer array: one array task per explorer, one process each."""

    trainer: SlurmRoleConfig = Field(default_factory=SlurmRoleConfig)
    """The trainer job: nodes x tasks_per_node ranks, started by srun."""

    evaluator: SlurmRoleConfig = Field(default_factory=SlurmRoleConfig)
    """The evaluator array of each stage with `eval.evaluator` (one array task per weights
    version scored), started once the stage's trainer succeeded."""

    helper: SlurmRoleConfig = Field(default_factory=SlurmRoleConfig)
    """The small jobs between stages (prepare the next stage) and at the end (summary.json,
    report.png). One task, 1 CPU and 30 minutes unless set here; partition, account, qos,
    setup, env, pass_env and container default to the trainer's."""

    signal_delay: int = Field(120, ge=0)
    """Seconds before the time limit at which Slurm sends SIGUSR2 to the roles
    (`--signal=USR2@N`; Slurm may send it up to a minute late): they stop at their next safe
    point, save, and the job requeues itself."""

    walltime_margin: float = Field(15.0, ge=0.0)
    """Seconds a role keeps free before its job's time limit besides its measured step and
    save times: when the next step would cut into them, it saves and requeues on its own,
    without waiting for the signal."""

    mpi: str = "pmi2"
    """srun's `--mpi` plugin for the trainer and explorer jobs of a stage with
    `sync.method: mpi` (`pmi2` for MPICH, `pmix` for Open MPI; see `srun --mpi=list`)."""

    max_restarts: int = Field(3, ge=0)
    """How often a job whose role process died (killed, crashed node process) requeues
    itself; a role that saved and asked to be requeued (signal, time limit) always is."""

    @field_validator("explorer", "helper")
    @classmethod
    def _one_process(cls, settings: SlurmRoleConfig, info: ValidationInfo) -> SlurmRoleConfig:
        if settings.tasks() != 1:
            raise ValueError(
                f"nodes x tasks_per_node must be 1: each {info.field_name} job is one process"
                + (" (set explorer.count for more explorers)"
                   if info.field_name == "explorer" else ""))
        return settings

    def helper_settings(self) -> SlurmRoleConfig:
        """The helper jobs' settings: `helper`'s own, else the defaults, else the trainer's."""
        inherited = self.trainer.model_dump(exclude=set(HELPER_DEFAULTS) | {"array_parallelism"})
        given = self.helper.model_dump(exclude_unset=True)
        return SlurmRoleConfig.model_validate({**inherited, **HELPER_DEFAULTS, **given})


class LaunchConfig(ConfigSection):
    """How `rft-hpc submit` runs the roles as Slurm jobs, and how the run directory is shared."""

    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """Slurm settings per role."""

    colocate: bool | Literal["auto"] = "auto"
    """Run explorer 0 and the trainer in one process on the same devices, weights handed
    over in memory (docs/colocated.md): true, false (a process each), or `auto`: colocated
    under `rft-hpc run` wherever it serves (mode both, one explorer, one trainer process,
    `sync.method: checkpoint`, no cores pinned apart), a process each under `rft-hpc
    submit`. Under Slurm a colocated stage is one job with the trainer's settings."""

    umask: str | None = None
    """Umask (quoted octal, e.g. `"0027"`) for the run directory and every file the roles
    write; null keeps the submitting user's umask."""

    group: str | None = None
    """Unix group to share the run directory with: it owns the folder, and the set-group-ID
    bit makes everything created inside inherit it. Null: the user's default group."""

    max_resubmits: int = Field(3, ge=0)
    """How many times `rft-hpc resume` (by hand, or the watchers of `submit --auto-resume`)
    may resubmit the run's failed jobs."""

    python: str | None = None
    """Python interpreter the jobs run rft-hpc with; null: the one running `rft-hpc submit`
    (a virtual environment on the shared filesystem), or `python3` inside a container."""

    @field_validator("umask", mode="before")
    @classmethod
    def _quoted(cls, value: object) -> object:
        if isinstance(value, int):
            raise ValueError(f"write the umask in quotes ('0027'): YAML reads an unquoted "
                             f"umask as a number (here {value})")
        return value

    @field_validator("umask")
    @classmethod
    def _octal(cls, value: str | None) -> str | None:
        if value is not None and not _UMASK.fullmatch(value):
            raise ValueError("expected an octal umask such as '0027' or '0002' (quoted)")
        return value
