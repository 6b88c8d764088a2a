"""Checks of the text-environment options (``env.text_env``, ``env.max_turns``, ``env.max_concurrency``,
``env.step_timeout_s``, ``env.on_error``; docs/environments.md).

Only the format is checked here (config/ imports nothing of envs/): whether the class imports and whether the
model's tokenizer has a chat template are launch checks (launch/text_env_check.py), and the rollout worker for
these runs is :mod:`asyncppo.envs.episode_worker`.
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
    c.optional_positive("env.max_tokens_per_turn", e.max_tokens_per_turn)
    if e.text_env is None:
        return
    if not isinstance(e.text_env, str) or not _DOTTED_CLASS.match(e.text_env):
        c.error("env.text_env", e.text_env, "must be a dotted class path such as my_pkg.envs.MyEnv "
                "(or my_pkg.envs:MyEnv)")
    elif e.id is not None:
        c.error("env.text_env", e.text_env, f"is a text environment; env.id={e.id!r} asks for a gymnasium run: "
                "set one of them")
