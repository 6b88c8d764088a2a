"""The model's inputs and outputs now live in :mod:`asyncppo.pipeline.model`; this name stays for existing callers."""

from asyncppo.pipeline.model import EngineSpeed, Result, Setup, TrainSpeed

__all__ = ["EngineSpeed", "Result", "Setup", "TrainSpeed"]
