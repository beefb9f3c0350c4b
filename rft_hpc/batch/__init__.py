"""Experiences as padded token tensors, and their per-token log-probs under a model."""
