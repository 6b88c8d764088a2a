"""A gymnasium environment for fault tests, importable by the env workers of a real launch as
``env.id=tests.gym_envs:WedgeCartPole-v1`` (gymnasium's ``module:id`` form: the import registers it).

``WedgeCartPole-v1`` is CartPole-v1 whose ``step`` can be made to never return, as a wedged simulator or a remote
environment that stopped answering would: with ``env.kwargs.wedge_file=PATH``, the first environment to step after a
test creates ``PATH`` claims it (an atomic rename to ``PATH.claimed``, so exactly one process wedges) and blocks
inside ``step`` for as long as the claimed file exists. Every other environment, and any started after the claim,
steps normally."""

from __future__ import annotations

import os
import time

import gymnasium
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class WedgeCartPole(CartPoleEnv):
    def __init__(self, wedge_file: str = "", **kwargs):
        super().__init__(**kwargs)
        self.wedge_file = wedge_file

    def step(self, action):
        if self.wedge_file and os.path.exists(self.wedge_file):
            claimed = self.wedge_file + ".claimed"
            try:
                os.rename(self.wedge_file, claimed)  # one claimant: the others find the file gone
            except OSError:
                pass
            else:
                while os.path.exists(claimed):
                    time.sleep(0.1)
        return super().step(action)


gymnasium.register("WedgeCartPole-v1", entry_point=WedgeCartPole, max_episode_steps=500, reward_threshold=475.0)
