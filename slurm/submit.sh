#!/bin/bash
# Submits the Slurm jobs of rft-hpc run @{run} in order: each job waits (afterok) for the
# jobs it needs, and is cancelled if one of them fails. Written by `rft-hpc render` from
# @{config}; `rft-hpc submit` submits the same scripts.
set -euo pipefail
cd "$(dirname "$0")"
@{submissions}
