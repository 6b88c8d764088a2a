"""Register the typed schema with Hydra's ConfigStore.

``configs/config.yaml`` names ``asyncppo_schema`` first in its defaults list, so every preset and command-line
override is merged *into* the dataclasses: a misspelt key or a string where a float belongs fails at compose time
instead of being carried along silently.
"""

from __future__ import annotations

from datetime import datetime

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from asyncppo.config.schema import AsyncPPOConfig

SCHEMA_NAME = "asyncppo_schema"


def register_schema() -> None:
    """Idempotent: store the schema and make sure ``${now:...}`` resolves outside a Hydra app too."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=AsyncPPOConfig)
    if not OmegaConf.has_resolver("now"):
        # Same semantics as Hydra's own resolver (cached: one timestamp per process and pattern).
        OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern), use_cache=True)
