"""What the tests share: the local Slurm cluster, worker programs, and the required-tool check."""
