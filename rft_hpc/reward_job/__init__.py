"""The reward job role: reward models scored for every explorer, in jobs of their own
(docs/reward-job.md)."""
