"""Shared basics of every layer: user errors, plugins, the config base, run directory, consoles."""
