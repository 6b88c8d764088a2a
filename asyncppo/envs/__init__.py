"""Embodied runs: gymnasium env workers, the MLP actor-critic, and segment building (docs/embodied.md).

The learner and the env workers meet only through :mod:`asyncppo.stream.segments` records, admission tickets and
the weight broadcast, exactly as LLM workers do. Submodules import torch and gymnasium; import them directly.

Text environments for multi-turn episodes (docs/environments.md): ``text_env`` (the per-episode ``init`` / ``step``
protocol, skyrl-gym's shape), ``tools`` (tool-call parsing), ``chat`` (rendering turns as appended token ids) and
``env_runner`` (environment calls off the loop, with a deadline each), ``episodes`` (multi-turn episodes around a
streaming rollout engine) and ``episode_groups`` (a finished group of episodes as the stream record).
"""
