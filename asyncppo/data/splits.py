"""The train/eval split of a built-in task, in a module of its own so that every task module can name it (the
registry in :mod:`asyncppo.data.tasks` imports the task modules)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSplits:
    train: list[dict]
    eval: list[dict]
