"""Metrics, heartbeats and reports of a run."""
