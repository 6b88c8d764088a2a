"""Configuration: typed schema (the only defaults), Hydra presets, validation and the loader.

Use :func:`load_config` everywhere: it returns a validated :class:`AsyncPPOConfig` with derived defaults filled.
"""

from asyncppo.config.loader import (
    CONFIG_DIR,
    ConfigWarning,
    compose,
    config_from_yaml,
    config_to_yaml,
    load_config,
)
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.config.validate import ConfigError, check_config, resolve_derived, validate_config

__all__ = [
    "AsyncPPOConfig",
    "CONFIG_DIR",
    "ConfigError",
    "ConfigWarning",
    "check_config",
    "compose",
    "config_from_yaml",
    "config_to_yaml",
    "load_config",
    "resolve_derived",
    "validate_config",
]
