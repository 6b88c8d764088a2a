"""Configuration: typed schema (the only defaults), Hydra presets, validation and the loader.

Use :func:`load_config` everywhere: it returns a validated :class:`AsyncPPOConfig` with derived defaults filled.
"""

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.config.validate import ConfigError, check_config, resolve_derived, validate_config

# The loader needs Hydra; it is imported on first use of one of these names (PEP 562), so that the schema and the
# validation import without it (``asyncppo selftest`` runs where Hydra is not installed).
_LOADER_NAMES = ("CONFIG_DIR", "ConfigWarning", "compose", "config_from_yaml", "config_to_yaml", "load_config")


def __getattr__(name: str):
    if name in _LOADER_NAMES:
        from asyncppo.config import loader  # optional: hydra, omegaconf

        return getattr(loader, name)
    raise AttributeError(f"module 'asyncppo.config' has no attribute {name!r}")

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
