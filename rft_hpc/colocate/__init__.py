"""The colocated placement: the trainer and explorer 0 in one process (docs/colocated.md)."""
