"""rft-hpc: reinforcement fine-tuning of language models as Slurm batch jobs."""

__version__ = "0.1.0"
