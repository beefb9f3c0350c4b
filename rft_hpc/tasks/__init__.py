"""Tasks: generated arithmetic and JSONL task files, and reward functions."""
