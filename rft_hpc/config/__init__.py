"""The experiment configuration: schema, loading with overrides, errors that name file and key."""

from rft_hpc.config.errors import ConfigError, Problem
from rft_hpc.config.loader import load_config
from rft_hpc.config.schema import ExperimentConfig

__all__ = ["ConfigError", "ExperimentConfig", "Problem", "load_config"]
