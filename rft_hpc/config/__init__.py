"""The experiment configuration: schema, loading with overrides, and errors users can act on.

    config = load_config("configs/demo.yaml", ["trainer.lr=1e-5"])

raises `ConfigError` (a `UserError`) listing every problem, each with file, key and line.
"""

from rft_hpc.config.errors import ConfigError, Problem
from rft_hpc.config.loader import load_config
from rft_hpc.config.schema import ExperimentConfig

__all__ = ["ConfigError", "ExperimentConfig", "Problem", "load_config"]
