"""Environments of multi-turn workflows: the world a policy acts in, turn by turn."""
