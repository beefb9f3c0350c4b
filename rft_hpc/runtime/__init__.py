"""The roles of an experiment (explorer, trainer), each a plain process entry point.

`rft-hpc run` starts them as local processes and `rft-hpc submit` (later) as Slurm jobs: the
role code is the same, only the launcher differs. A role reads everything it needs from its
stage directory (a run directory with a frozen `config.yaml`).
"""
