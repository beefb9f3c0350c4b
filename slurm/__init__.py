"""The sbatch templates, installed as package `rft_hpc.slurm` (setup.py; read by
rft_hpc/launch/sbatch.py with importlib.resources). Edit the templates here."""
