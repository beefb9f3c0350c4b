"""The colocated placement: an explorer and the trainer in one process, on the same devices
(`launch.colocate`, docs/colocated.md)."""
