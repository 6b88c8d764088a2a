"""Checks of the text-environment options (``env.text_env``, ``env.max_turns``, ``env.max_concurrency``,
``env.step_timeout_s``, ``env.on_error``; docs/environments.md).

Why ``env.text_env`` is refused for a launch today: the protocol, the parsing and the off-loop runner exist
(:mod:`asyncppo.envs`), and so does the loop that runs episodes through an engine (:mod:`asyncppo.envs.episodes`),
but the rollout worker does not use it yet; a run that accepted the option would silently train single-turn. The format is still checked first, so the message names the real problem.
"""

from __future__ import annotations

import re

from asyncppo.config.checks import Checks
from asyncppo.config.schema import AsyncPPOConfig

#: What ``env.on_error`` may be: ``drop`` the episode's group slot (regenerated), or end the episode with reward 0.
ENV_ON_ERROR = ("drop", "zero_reward")
_DOTTED_CLASS = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*[.:][A-Za-z_]\w*$")


def check_text_env(cfg: AsyncPPOConfig, c: Checks) -> None:
    e = cfg.env
    c.choice("env.on_error", e.on_error, ENV_ON_ERROR)
    for key in ("max_turns", "max_concurrency", "step_timeout_s"):
        c.positive(f"env.{key}", getattr(e, key))
    if e.text_env is None:
        return
    if not isinstance(e.text_env, str) or not _DOTTED_CLASS.match(e.text_env):
        c.error("env.text_env", e.text_env, "must be a dotted class path such as my_pkg.envs.MyEnv "
                "(or my_pkg.envs:MyEnv)")
    elif e.id is not None:
        c.error("env.text_env", e.text_env, f"is a text environment; env.id={e.id!r} asks for a gymnasium run: "
                "set one of them")
    else:
        c.error("env.text_env", e.text_env, "the multi-turn rollout loop is not wired into launch yet "
                "(docs/environments.md, Status); episodes run from Python through asyncppo.envs.episodes")
