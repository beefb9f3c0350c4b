"""Evaluation of a policy on held-out task sets."""
