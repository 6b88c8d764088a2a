"""Reward functions that misbehave on purpose, importable by rollout workers as ``tests.failure_helpers:NAME``."""

from __future__ import annotations

import os

_calls = {"n": 0}


def die_after_some(response_text: str, answer: str, **_kw) -> float:
    """Kills its process (a rollout worker) hard after a few hundred calls: a worker that dies mid-run."""
    _calls["n"] += 1
    if _calls["n"] > 300:
        os._exit(17)
    return float(response_text.strip() == answer)


def raise_sometimes(response_text: str, answer: str, **_kw) -> float:
    """Raises on every third call: a buggy reward function must be counted, never kill the worker."""
    _calls["n"] += 1
    if _calls["n"] % 3 == 0:
        raise ValueError("reward function bug")
    return float(response_text.strip() == answer)


def raise_sometimes_math(response_text: str, answer: str, **kw) -> float:
    """:func:`raise_sometimes` over the built-in math-verify scorer (``reward_fn=math``), for GSM8K-style rows."""
    from asyncppo.data.rewards import math_reward

    _calls["n"] += 1
    if _calls["n"] % 3 == 0:
        raise ValueError("reward function bug")
    return math_reward(response_text, answer, **kw)
