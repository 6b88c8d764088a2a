"""Build gymnasium environments from ``cfg.env`` and turn their spaces into the shapes the rest of asyncppo uses.

Every problem a user can cause is reported here as :class:`EnvError` with the key to change: an unknown id (with
gymnasium's own suggestion), an action space the MLP policy cannot drive, an observation space it cannot read. The
launcher calls :func:`describe_env` on the driver before Ray starts, so these fail in a second instead of inside an
actor; workers call :func:`make_vector_env`.

Vector envs use gymnasium's ``SAME_STEP`` autoreset: a finished env is reset inside the step that ended it, the
returned observation is the new episode's first, and the true final observation is in ``info["final_obs"]``. That
is what lets a segment carry the final observation of a truncated episode for the bootstrap value, without the
dummy "reset" steps of the default ``NEXT_STEP`` mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncppo.models.actor_critic import PolicySpec
from asyncppo.stream.segments import SegmentSpec


class EnvError(ValueError):
    """A configuration problem with ``env.*`` the user can fix."""


@dataclass(frozen=True)
class EnvDescription:
    """What the policy, the worker and the learner need to know about an environment."""

    env_id: str
    obs_shape: tuple[int, ...]
    discrete: bool
    action_dim: int  # actions (discrete) or action vector size (continuous)
    action_low: Any = None  # continuous: bounds the worker clips to before stepping
    action_high: Any = None

    @property
    def segment_spec(self) -> SegmentSpec:
        if self.discrete:
            return SegmentSpec(self.obs_shape, (), "<i8", self.action_dim)
        return SegmentSpec(self.obs_shape, (self.action_dim,), "<f4", None)

    def policy_spec(self, cfg) -> PolicySpec:
        m = cfg.model
        return PolicySpec(obs_dim=int(math.prod(self.obs_shape)), discrete=self.discrete, action_dim=self.action_dim,
                          hidden_sizes=tuple(m.hidden_sizes), activation=m.activation,
                          shared_backbone=m.shared_backbone, normalize_obs=cfg.env.normalize_obs,
                          obs_clip=cfg.env.obs_clip, init_log_std=m.init_log_std)


def _make_kwargs(env_cfg) -> dict:
    kwargs = dict(env_cfg.kwargs or {})
    if env_cfg.max_episode_steps is not None:
        kwargs["max_episode_steps"] = int(env_cfg.max_episode_steps)
    return kwargs


def _check_id(env_id: str) -> None:
    """``env_id`` names a registered environment. ``"my_pkg.envs:MyEnv-v0"`` (gymnasium's own form, which ``make``
    and ``make_vec`` read) first imports ``my_pkg.envs``, whose import registers the environment: that is how a
    user's environment reaches every env worker's process without an install step."""
    import importlib

    import gymnasium  # heavy/optional: gymnasium (embodied runs only)
    from gymnasium import error as gym_error  # heavy/optional: gymnasium

    module, sep, name = env_id.rpartition(":")
    if sep:
        try:
            importlib.import_module(module)
        except Exception as exc:  # not found, or its import raised: either way the id cannot be resolved
            raise EnvError(f"env.id={env_id!r}: the module {module!r} that should register {name!r} could not be "
                           f"imported ({type(exc).__name__}: {exc})") from None
    try:
        gymnasium.spec(name)
    except (gym_error.NameNotFound, gym_error.NamespaceNotFound, gym_error.VersionNotFound,
            gym_error.DeprecatedEnv, gym_error.UnregisteredEnv) as exc:
        raise EnvError(f"env.id={env_id!r}: not a registered gymnasium environment ({exc}). "
                       "See gymnasium.pprint_registry() for the ids installed here") from None
    except gym_error.Error as exc:
        raise EnvError(f"env.id={env_id!r}: {exc}") from None


def describe_spaces(env_id: str, observation_space, action_space) -> EnvDescription:
    """Check the spaces are ones the MLP actor-critic supports; EnvError naming the space otherwise."""
    from gymnasium import spaces  # heavy/optional: gymnasium

    obs = observation_space
    if not isinstance(obs, spaces.Box) or not np.issubdtype(obs.dtype, np.floating):
        raise EnvError(f"env.id={env_id!r}: observation space {obs} is not supported; the MLP policy reads float "
                       "Box observations (images and Discrete/Dict observations need another policy)")
    act = action_space
    if isinstance(act, spaces.Discrete):
        if int(act.start) != 0:
            raise EnvError(f"env.id={env_id!r}: action space {act} starts at {act.start}; only Discrete(n) from 0")
        return EnvDescription(env_id, tuple(obs.shape), True, int(act.n))
    if isinstance(act, spaces.Box) and len(act.shape) == 1 and np.issubdtype(act.dtype, np.floating):
        return EnvDescription(env_id, tuple(obs.shape), False, int(act.shape[0]),
                              np.asarray(act.low, np.float32), np.asarray(act.high, np.float32))
    raise EnvError(f"env.id={env_id!r}: action space {act} is not supported; supported: Discrete(n) "
                   "(categorical policy) and a 1-D float Box (diagonal Gaussian)")


def describe_env(env_cfg) -> EnvDescription:
    """Resolve ``env.id``, build one env to read its spaces, and check them (driver-side, before anything starts)."""
    import gymnasium  # heavy/optional: gymnasium

    if not env_cfg.id:
        raise EnvError("env.id is not set: choose env=cartpole or env=<gymnasium id>")
    _check_id(env_cfg.id)
    try:
        env = gymnasium.make(env_cfg.id, **_make_kwargs(env_cfg))
    except Exception as exc:  # missing extras (mujoco, box2d), bad kwargs: say which env and why
        raise EnvError(f"env.id={env_cfg.id!r}: gymnasium.make failed: {type(exc).__name__}: {exc}") from None
    try:
        return describe_spaces(env_cfg.id, env.observation_space, env.action_space)
    finally:
        env.close()


def make_vector_env(env_cfg, num_envs: int):
    """A gymnasium vector env with ``SAME_STEP`` autoreset (module docstring)."""
    import gymnasium  # heavy/optional: gymnasium
    from gymnasium.vector import AutoresetMode  # heavy/optional: gymnasium

    _check_id(env_cfg.id)
    return gymnasium.make_vec(
        env_cfg.id, num_envs=num_envs, vectorization_mode=env_cfg.vectorization,
        vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}, **_make_kwargs(env_cfg),
    )
