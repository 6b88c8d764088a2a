"""Embodied runs: gymnasium env workers, the MLP actor-critic, and segment building (docs/embodied.md).

The learner and the env workers meet only through :mod:`asyncppo.stream.segments` records, admission tickets and
the weight broadcast, exactly as LLM workers do. Submodules import torch and gymnasium; import them directly.
"""
