"""The text-environment protocol: an environment created per episode that answers the model's turns.

The shape is skyrl-gym's ``BaseTextEnv``, so that environments written for it run unchanged:

* ``init(prompt_messages) -> (messages, info)``: the conversation the model starts from (chat messages, dicts with
  ``role`` and ``content``), usually the prompt itself;
* ``step(action_text) -> (observation_messages, reward, done, info)``: the model's turn as text in, the
  environment's reply (messages to append), the turn's reward, whether the episode ended, and free-form info.
  skyrl-gym returns a mapping (``observations``, ``reward``, ``done``, ``metadata``); both forms are accepted;
* ``close()`` (optional): release what the episode held.

An environment may also declare ``tools``: JSON schemas (the OpenAI function format) handed to the chat template
(``apply_chat_template(..., tools=...)``), and ``step`` or ``init`` may be coroutine functions (an environment that
awaits a tool's latency). Environments are untrusted code from the trainer's point of view: everything they return
is checked here (:func:`normalize_step`) and a break is a :class:`MalformedStep`, which the runner
(:mod:`asyncppo.envs.env_runner`) handles per ``env.on_error`` instead of raising into the rollout.
"""

from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from omegaconf import OmegaConf


class TextEnv:
    """Base class (optional: any object with ``init`` and ``step`` will do). Constructed per episode as
    ``cls(env_config, extras)``, as skyrl-train constructs skyrl-gym environments (``extras``: the dataset row's
    fields, e.g. its reference answer)."""

    tools: list = []  # JSON schemas of the tools the model may call (rendered by the chat template)

    def __init__(self, env_config: Optional[Mapping] = None, extras: Optional[Mapping] = None):
        self.env_config = dict(env_config or {})
        self.extras = dict(extras or {})

    def init(self, prompt_messages: list) -> tuple[list, dict]:
        return list(prompt_messages), {}

    def step(self, action_text: str):
        raise NotImplementedError("a text environment implements step(action_text)")

    def close(self) -> None:
        pass


class MalformedStep(ValueError):
    """What an environment returned breaks the protocol; ``kind`` is ``malformed`` or ``nonfinite_reward``."""

    def __init__(self, kind: str, detail: str):
        self.kind = kind
        super().__init__(detail)


@dataclass
class StepResult:
    observations: list  # chat messages to append ([] when the episode ends without a reply)
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


def check_messages(messages: Any, what: str) -> list:
    """``messages`` as a list of ``{"role": str, "content": str, ...}`` dicts, else :class:`MalformedStep`."""
    if not isinstance(messages, (list, tuple)):
        raise MalformedStep("malformed", f"{what} must be a list of chat messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise MalformedStep("malformed", f"{what}[{i}] must be a dict with str 'role' and 'content', got {m!r:.80}")
    return [dict(m) for m in messages]


def check_reward(reward: Any, what: str = "reward") -> float:
    """``reward`` as a float: a finite real number, not a bool; else :class:`MalformedStep` (``malformed`` or
    ``nonfinite_reward``)."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise MalformedStep("malformed", f"{what} must be a real number, got {type(reward).__name__}")
    if not math.isfinite(float(reward)):
        raise MalformedStep("nonfinite_reward", f"{what} {reward!r} is not finite")
    return float(reward)


def normalize_step(out: Any) -> StepResult:
    """A :class:`StepResult` from either step form (a 4-tuple, or skyrl-gym's mapping); :class:`MalformedStep`
    when the form, the messages or the reward (a finite real number, not a bool) are wrong."""
    if isinstance(out, Mapping):
        missing = [k for k in ("observations", "reward", "done") if k not in out]
        if missing:
            raise MalformedStep("malformed", f"step returned a mapping without {missing}")
        obs, reward, done, info = out["observations"], out["reward"], out["done"], out.get("metadata") or {}
    elif isinstance(out, tuple) and len(out) == 4:
        obs, reward, done, info = out
    else:
        raise MalformedStep("malformed", "step must return (observations, reward, done, info) or a mapping with "
                                         f"observations/reward/done/metadata, got {type(out).__name__}")
    obs = check_messages(obs, "observations")
    reward = check_reward(reward)
    if not isinstance(done, (bool, int)):
        raise MalformedStep("malformed", f"done must be a bool, got {type(done).__name__}")
    if not isinstance(info, Mapping):
        raise MalformedStep("malformed", f"info must be a mapping, got {type(info).__name__}")
    return StepResult(obs, reward, bool(done), dict(info))


def normalize_init(out: Any) -> tuple[list, dict]:
    """``(messages, info)`` from ``init``'s return value, else :class:`MalformedStep`."""
    if not isinstance(out, tuple) or len(out) != 2 or not isinstance(out[1], Mapping):
        raise MalformedStep("malformed", "init must return (messages, info)")
    return check_messages(out[0], "init messages"), dict(out[1])


def import_named(path: str, option: str, expected: str) -> Any:
    """The object a config option names as ``pkg.module.name`` or ``pkg.module:name``; ValueError naming ``option``
    when the path has no module part (``expected`` says what form was expected) or does not import."""
    module_name, sep, name = str(path).replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ValueError(f"{option}={path!r}: expected {expected}")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{option}={path!r}: cannot import it ({type(e).__name__}: {e})") from None


def load_text_env(path: str) -> type:
    """The class named by ``env.text_env`` (``pkg.module.Class`` or ``pkg.module:Class``); ValueError naming the
    option when it cannot be imported or is not a class with ``init`` and ``step``."""
    cls = import_named(path, "env.text_env", "a dotted class path such as my_pkg.envs.MyEnv")
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)) \
            or not callable(getattr(cls, "init", None)):
        raise ValueError(f"env.text_env={path!r}: not a class with init() and step() (got {cls!r:.80})")
    return cls


def make_text_env(cls: type, extras: Optional[Mapping] = None, env_config: Optional[Mapping] = None, *,
                  max_turns: Optional[int] = None) -> Any:
    """One episode's environment, constructed as skyrl-train constructs skyrl-gym environments:
    ``cls(env_config=..., extras=...)``, keywords, with ``env_config`` an OmegaConf ``DictConfig`` (skyrl-gym's
    environments read it by attribute or by key) and ``extras`` the dataset row's fields (all but the prompt and
    ``env_class``; :meth:`asyncppo.data.text_rows.TextEnvRow.episode_extras`) plus ``max_turns`` (``env.max_turns``),
    which skyrl-train adds and e.g. skyrl-gym's multi-turn GSM8K environment reads. A row's own ``max_turns``
    gives way to the run's, as in skyrl-train. ValueError naming ``env.text_env`` when the constructor raises, so
    that a class that does not take these arguments is reported as such rather than as a fault of one episode."""
    extras = dict(extras or {})
    if max_turns is not None:
        extras["max_turns"] = int(max_turns)
    config = OmegaConf.create(dict(env_config or {}))
    try:
        return cls(env_config=config, extras=extras)
    except Exception as e:
        name = f"{cls.__module__}.{cls.__qualname__}"
        raise ValueError(f"env.text_env={name!r}: constructing it as cls(env_config=..., extras=...) with the row's "
                         f"fields {sorted(extras)} failed: {type(e).__name__}: {e}") from e
