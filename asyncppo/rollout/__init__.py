"""Rollout: the engine interface, its vLLM and transformers backends, and the rollout worker loop."""

from .engine import Completion, RolloutEngine
from .engines import make_engine

__all__ = ["Completion", "RolloutEngine", "make_engine"]
