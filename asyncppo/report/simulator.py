"""The pipeline simulator now lives in :mod:`asyncppo.pipeline.simulator` (a floor the learner's window tuner may
import too); this name stays so that existing callers and runs' scripts keep working."""

from asyncppo.pipeline.simulator import EngineSpeed, Result, Setup, Simulator, TrainSpeed, simulate

__all__ = ["EngineSpeed", "Result", "Setup", "Simulator", "TrainSpeed", "simulate"]
