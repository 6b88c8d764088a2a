"""Synthetic tasks with verifiable answers, generated locally so that a run needs no downloaded data.

The built-in task is zero-padded two-digit addition (``07+45=`` -> ``52``). Zero padding makes every prompt the
same length (six characters, six tokens with the char-level tokenizer), so batches need no padding and a tiny
model can learn the task in a few minutes on two CPU cores: a task where a PPO run *visibly* improves the
policy is the cheapest end-to-end check that the whole system works.

Train and eval splits are a deterministic shuffle of all operand pairs by ``seed``: the held-out eval prompts
never appear in the train split, so eval accuracy measures generalisation rather than memorisation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class TaskSplits:
    train: list[dict]
    eval: list[dict]


class AdditionTask:
    """``a+b=`` with zero-padded ``digits``-digit operands; the answer is the decimal sum without padding."""

    name = "addition"
    default_reward = "exact_match"

    def __init__(self, digits: int = 2, seed: int = 0, num_eval: int = 256):
        if digits < 1 or digits > 4:
            raise ValueError(f"addition task: digits={digits!r} not allowed (1..4)")
        total = (10**digits) ** 2
        if not 0 <= num_eval < total:
            raise ValueError(f"addition task: num_eval={num_eval!r} must be in [0, {total})")
        self.digits = digits
        self.seed = seed
        self.num_eval = num_eval

    def format_prompt(self, a: int, b: int) -> str:
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}="

    @staticmethod
    def format_answer(a: int, b: int) -> str:
        return str(a + b)

    def row(self, a: int, b: int) -> dict:
        return {"prompt": self.format_prompt(a, b), "answer": self.format_answer(a, b)}

    def splits(self) -> TaskSplits:
        """All operand pairs, shuffled by ``seed``; the first ``num_eval`` are held out for evaluation."""
        n = 10**self.digits
        pairs = [(a, b) for a in range(n) for b in range(n)]
        random.Random(self.seed).shuffle(pairs)
        rows = [self.row(a, b) for a, b in pairs]
        return TaskSplits(train=rows[self.num_eval :], eval=rows[: self.num_eval])

    def alphabet(self) -> str:
        """Every character a prompt or answer can contain (the char-level tokenizer's vocabulary)."""
        return "0123456789+="


_TASKS: dict[str, Callable[..., object]] = {"addition": AdditionTask}


def register_task(name: str, factory: Callable[..., object]) -> None:
    _TASKS[name] = factory


def get_task(name: str, **kwargs):
    """Build a registered task by name (``kwargs`` go to its constructor, e.g. ``seed``, ``num_eval``)."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {sorted(_TASKS)}")
    return _TASKS[name](**kwargs)


def available_tasks() -> list[str]:
    return sorted(_TASKS)
