"""A gymnasium environment for fault tests, importable by the env workers of a real launch as
``env.id=tests.gym_envs:FaultyCartPole-v1`` (gymnasium's ``module:id`` form: the import registers it).

``FaultyCartPole-v1`` is CartPole-v1 with three faults, each off unless its keyword (``env.kwargs.*``) is set:

* ``wedge_file=PATH``: ``step`` never returns, as a wedged simulator or a remote environment that stopped answering
  would. The first environment to step after a test creates ``PATH`` claims it (an atomic rename to
  ``PATH.claimed``, so exactly one process wedges) and blocks inside ``step`` for as long as the claimed file exists;
* ``raise_file=PATH``: the first environment to step after ``PATH`` appears claims it the same way and raises
  ``RuntimeError`` once;
* ``raise_every=N``: every environment raises ``RuntimeError`` on its N-th step, and on every N-th after it
  (``N = 1``: on every step, an environment that is simply broken).

Every other environment, and any started after a claim, steps normally."""

from __future__ import annotations

import os
import time

import gymnasium
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


def _claim(path: str) -> bool:
    """True for exactly one caller once ``path`` exists: the one whose rename to ``path.claimed`` succeeded."""
    if not path or not os.path.exists(path):
        return False
    try:
        os.rename(path, path + ".claimed")
    except OSError:
        return False
    return True


class FaultyCartPole(CartPoleEnv):
    def __init__(self, wedge_file: str = "", raise_file: str = "", raise_every: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.wedge_file, self.raise_file, self.raise_every = wedge_file, raise_file, int(raise_every)
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.raise_every and self.steps % self.raise_every == 0:
            raise RuntimeError(f"FaultyCartPole: scripted error at step {self.steps}")
        if _claim(self.raise_file):
            raise RuntimeError("FaultyCartPole: scripted error (raise_file)")
        if _claim(self.wedge_file):
            while os.path.exists(self.wedge_file + ".claimed"):
                time.sleep(0.1)
        return super().step(action)


gymnasium.register("FaultyCartPole-v1", entry_point=FaultyCartPole, max_episode_steps=500, reward_threshold=475.0)
