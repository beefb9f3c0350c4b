#!/bin/bash
# Submits the Slurm jobs of rft-hpc run golden in order: each job waits (afterok) for the
# jobs it needs, and is cancelled if one of them fails. Written by `rft-hpc render` from
# <CWD>/configs/demo.yaml; `rft-hpc submit` submits the same scripts.
set -euo pipefail
cd "$(dirname "$0")"
job0=$(sbatch --parsable sft.trainer.sbatch)
echo sft.trainer: "${job0%%;*}"
job1=$(sbatch --parsable --kill-on-invalid-dep=yes --dependency=afterok:${job0%%;*} grpo.prepare.sbatch)
echo grpo.prepare: "${job1%%;*}"
job2=$(sbatch --parsable --kill-on-invalid-dep=yes --dependency=afterok:${job1%%;*} grpo.explorer.sbatch)
echo grpo.explorer: "${job2%%;*}"
job3=$(sbatch --parsable --kill-on-invalid-dep=yes --dependency=afterok:${job1%%;*} grpo.trainer.sbatch)
echo grpo.trainer: "${job3%%;*}"
job4=$(sbatch --parsable --kill-on-invalid-dep=yes --dependency=afterok:${job3%%;*} grpo.evaluator.sbatch)
echo grpo.evaluator: "${job4%%;*}"
job5=$(sbatch --parsable --kill-on-invalid-dep=yes --dependency=afterok:${job2%%;*}:${job3%%;*}:${job4%%;*} finalize.sbatch)
echo finalize: "${job5%%;*}"
