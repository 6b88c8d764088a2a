"""Reward functions ``fn(response_text, answer, **kw) -> float`` and how a configuration names them.

A reward function is user code running inside the rollout worker: :func:`score_safely` makes sure a function
that raises costs one sample a 0.0 reward (counted as failed), never the worker.

math-verify guards parsing and comparison with ``signal.alarm`` timeouts, which only work in the main thread;
elsewhere it would refuse to run. :func:`math_reward` therefore passes timeouts only in the main thread and
runs without them in other threads (the inputs here are short model responses).
"""

from __future__ import annotations

import importlib
import threading
from typing import Callable, Optional

from .tasks import get_task

RewardFn = Callable[..., float]


def exact_match(response_text: str, answer: str, **kw) -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response_text.strip() == str(answer).strip() else 0.0


def math_reward(response_text: str, answer: str, timeout_s: int = 5, **kw) -> float:
    """1.0 when math-verify finds the response's final answer (last boxed / number) equal to ``answer``."""
    from math_verify import parse, verify  # heavy/optional: math-verify

    t = timeout_s if threading.current_thread() is threading.main_thread() else None
    gold = parse(str(answer), parsing_timeout=t)
    if not gold:
        gold = parse(f"${answer}$", parsing_timeout=t)
    pred = parse(response_text, parsing_timeout=t)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0


_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math": math_reward}


def register_reward(name: str, fn: RewardFn) -> None:
    _REWARDS[name] = fn


def resolve_reward_fn(spec: str, *, task: Optional[str] = None, builtin_task: bool = False) -> RewardFn:
    """A built-in name (``exact_match``, ``math``), ``auto``, or a dotted path ``pkg.mod:fn`` / ``pkg.mod.fn``.

    ``auto``: when training on a built-in synthetic task (``task`` names it, or ``builtin_task=True``) the task's
    own reward (exact match for addition: answers are plain integers); otherwise math-verify (free-form
    reasoning where ``0.5`` and ``\\frac{1}{2}`` must both count).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward_fn={spec!r} must be a non-empty string")
    if spec == "auto":
        if task is not None:
            return resolve_reward_fn(getattr(get_task(task), "default_reward", "exact_match"))
        return exact_match if builtin_task else math_reward
    if spec in _REWARDS:
        return _REWARDS[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    elif "." in spec:
        module_name, _, attr = spec.rpartition(".")
    else:
        raise ValueError(
            f"reward_fn={spec!r} is not a built-in ({sorted(_REWARDS)} or 'auto') nor a dotted path 'pkg.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward_fn={spec!r}: cannot import module {module_name!r}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward_fn={spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward_fn={spec!r} resolves to a non-callable {type(obj).__name__}")
    return obj


def score_safely(fn: RewardFn, response_text: str, answer: str, **kw) -> tuple[float, bool, Optional[str]]:
    """``(reward, failed, error)``: a raising function or a non-finite / non-numeric result scores 0.0, failed."""
    try:
        value = fn(response_text, answer, **kw)
        reward = float(value)
    except Exception as exc:  # user code: any failure is one failed sample, not a dead worker
        return 0.0, True, f"{type(exc).__name__}: {exc}"
    if reward != reward or reward in (float("inf"), float("-inf")):
        return 0.0, True, f"reward function returned a non-finite value {value!r}"
    return reward, False, None
