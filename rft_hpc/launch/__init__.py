"""Running an experiment as Slurm jobs: config, sbatch scripts, submission, status."""
