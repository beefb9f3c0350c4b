"""Tasks, task sets, the deterministic task stream, and reward functions."""
