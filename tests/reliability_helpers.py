"""Reward functions for tests/e2e/test_e2e_reliability.py, importable by rollout workers as
``tests.reliability_helpers:NAME``. Both score exactly like the built-in exact match, so a run using either trains
on the same numbers; the second one stops its worker for good after a fixed number of samples."""

from __future__ import annotations

import time

from asyncppo.data.rewards import exact_match

_calls = {"n": 0}
STALL_AFTER = 32  # samples scored before the worker hangs (4 steps of 2 groups x 4 samples)


def exact(response_text: str, answer: str, **kw) -> float:
    return exact_match(response_text, answer, **kw)


def exact_then_hang(response_text: str, answer: str, **kw) -> float:
    """Scores like :func:`exact`, then hangs forever: the run stops making progress at a known step, so the test
    can kill the learner there, after its checkpoint and before the end."""
    _calls["n"] += 1
    if _calls["n"] > STALL_AFTER:
        time.sleep(3600)
    return exact_match(response_text, answer, **kw)


_marker: list = []


def exact_slow_while_marked(response_text: str, answer: str, **kw) -> float:
    """Scores like :func:`exact`, 0.1 s per sample while the file ``<run dir>/SLOW`` exists: the test slows the
    surviving worker down while a replacement starts, so the run still has steps left when the replacement joins
    (found from this process's log file, ``<run dir>/logs/worker-N.log``, which the launcher points stdout at)."""
    import os

    if not _marker:
        log = os.readlink("/proc/self/fd/1")
        _marker.append(os.path.join(os.path.dirname(os.path.dirname(log)), "SLOW"))
    if os.path.exists(_marker[0]):
        time.sleep(0.1)
    return exact_match(response_text, answer, **kw)
