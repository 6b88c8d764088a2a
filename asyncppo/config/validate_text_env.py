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
from asyncppo.config.validate_window import widest_lookahead

#: What ``env.on_error`` may be: ``drop`` the episode's group slot (regenerated), or end the episode with reward 0.
ENV_ON_ERROR = ("drop", "zero_reward")
#: What ``env.agent_branches`` may be: a call rewriting the agent's history starts a branch and the last one trains
#: (``final``) or every one does (``all``), or it is refused with 409 (docs/agents.md, "Branches").
AGENT_BRANCHES = ("final", "all", "refuse")
_DOTTED_CLASS = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*[.:][A-Za-z_]\w*$")


def check_text_env(cfg: AsyncPPOConfig, c: Checks) -> None:
    e = cfg.env
    c.choice("env.on_error", e.on_error, ENV_ON_ERROR)
    for key in ("max_turns", "step_timeout_s"):
        c.positive(f"env.{key}", getattr(e, key))
    c.non_negative("env.max_concurrency", e.max_concurrency)  # 0: auto (resolve_env_concurrency)
    c.optional_positive("env.max_tokens_per_turn", e.max_tokens_per_turn)
    _check_agent(cfg, c)
    if e.text_env is None:
        return
    if not isinstance(e.text_env, str) or not _DOTTED_CLASS.match(e.text_env):
        c.error("env.text_env", e.text_env, "must be a dotted class path such as my_pkg.envs.MyEnv "
                "(or my_pkg.envs:MyEnv)")
    elif e.id is not None:
        c.error("env.text_env", e.text_env, f"is a text environment; env.id={e.id!r} asks for a gymnasium run: "
                "set one of them")


#: The text environment an agent run plays: the adapter that turns the agent's calls into turns (agents/episode.py).
AGENT_TEXT_ENV = "asyncppo.agents.episode.AgentEpisode"


def _check_agent(cfg: AsyncPPOConfig, c: Checks) -> None:
    e = cfg.env
    if e.agent is None:
        if e.reward_fn is not None:
            c.error("env.reward_fn", e.reward_fn, "scores an agent's episodes: set env.agent too")
        return
    for key in ("agent", "reward_fn"):
        value = getattr(e, key)
        if value is not None and (not isinstance(value, str) or not _DOTTED_CLASS.match(value)):
            c.error(f"env.{key}", value, "must be pkg.module:function")
    if e.text_env not in (None, AGENT_TEXT_ENV):
        c.error("env.agent", e.agent, f"and env.text_env={e.text_env!r} are two ways to play an episode: set one")
    if e.id is not None:
        c.error("env.agent", e.agent, f"plays text episodes; env.id={e.id!r} asks for a gymnasium run: set one")
    if not 0 <= int(e.agent_port) <= 65535:
        c.error("env.agent_port", e.agent_port, "must be 0 (a free port) or a port number")
    c.positive("env.agent_max_body_bytes", e.agent_max_body_bytes)
    c.choice("env.agent_branches", e.agent_branches, AGENT_BRANCHES)
    if not isinstance(e.agent_host, str) or not e.agent_host:
        c.error("env.agent_host", e.agent_host, "must be an address such as 127.0.0.1")


def resolve_agent(cfg: AsyncPPOConfig) -> None:
    """``env.agent`` set: the episodes are played by the agent adapter (``env.text_env``)."""
    if cfg.env.agent is not None:
        cfg.env.text_env = AGENT_TEXT_ENV


#: The largest ``env.max_concurrency`` the auto value (0) resolves to: a bound on one worker's threads for
#: blocking environments, which start only when calls need them (envs/env_runner.py).
AUTO_ENV_CONCURRENCY_MAX = 256


def resolve_env_concurrency(cfg: AsyncPPOConfig) -> None:
    """``env.max_concurrency=0``: as many environment calls at once as the episodes one worker may hold, the
    staleness window ``(j + 1) * B`` groups of ``n`` episodes (under an auto lookahead the widest it may reach:
    :func:`~asyncppo.config.validate_window.widest_lookahead`), at most :data:`AUTO_ENV_CONCURRENCY_MAX`.

    Why not a small fixed pool: behind a slow tool most episodes in flight are at their environment (behind 200 ms
    ~80% of them, docs/benchmarks.md, "Latency hiding"), and a pool of 16 capped such a worker at 16 calls at once,
    i.e. ~21 episodes a second, far below what its engine decodes. A fast environment never uses more than a few
    threads, and threads start only when calls need them."""
    if cfg.env.max_concurrency == 0:
        r = cfg.rollout
        # an auto lookahead may widen during the run, and the pool is sized once, at the start
        episodes = (widest_lookahead(r) + 1) * r.rollout_batch_size * r.num_return_sequences_in_group
        cfg.env.max_concurrency = max(1, min(AUTO_ENV_CONCURRENCY_MAX, episodes))
