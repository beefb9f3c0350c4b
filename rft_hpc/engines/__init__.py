"""Inference engines the explorers sample rollouts from."""
