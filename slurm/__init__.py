"""The sbatch templates, shipped as package rft_hpc.slurm (setup.py); edit them here."""
