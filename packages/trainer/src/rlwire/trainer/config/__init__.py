"""The configuration: the root ``TrainerConfig`` with loading, overrides and presets, the
sections without another home, and verl's key names.

Imports every subpackage's own config section (``actor``, ``rollout``, ``agent``,
``algorithms``, ``data``, ``outputs``); nothing below it imports the config at run time."""

from .reference import describe_config
from .root import PRESETS, ConfigError, TrainerConfig, load_config, to_dict

__all__ = ["PRESETS", "ConfigError", "TrainerConfig", "describe_config", "load_config", "to_dict"]
