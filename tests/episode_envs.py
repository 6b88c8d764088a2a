"""Text environments for tests of multi-turn launches, importable by the run's actors (tests/ on PYTHONPATH)."""

from __future__ import annotations

import time

from asyncppo.envs.examples import GuessEnv


#: How long FaultyGuessEnv's hanging step sleeps: well past the launch test's ``env.step_timeout_s`` (2 s).
HANG_S = 6.0


class FaultyGuessEnv(GuessEnv):
    """The guess game, except that the hidden number picks a fault (the ``n`` episodes of a group share it):

    * 0: ``init`` raises: nothing to train, so the group is dropped whatever ``env.on_error`` says, and its
      admission ticket is given back;
    * 1: the second guess hangs for :data:`HANG_S`, past the deadline (fault ``timeout``);
    * 2: the second guess is answered with a message whose content is not a string (``malformed``);
    * 3: the second guess earns a NaN reward (``nonfinite_reward``).

    Under ``env.on_error=zero_reward`` the episodes of 1-3 end at that turn with reward 0 and their groups train;
    every other game is the plain guess game. A row with ``"free_win": true`` (an eval file's) wins 1.0 at the
    first turn, whatever the model says: its episodes score a known number."""

    def init(self, prompt_messages: list):
        if self.target == 0:
            raise RuntimeError("scripted fault: the environment could not start")
        return super().init(prompt_messages)

    def step(self, action_text: str):
        if self.extras.get("free_win"):
            return [], 1.0, True, {}
        if self.turns == 1 and self.target in (1, 2, 3):
            self.turns += 1
            if self.target == 1:
                time.sleep(HANG_S)
                return [{"role": "user", "content": "too late"}], 0.0, False, {}
            if self.target == 2:
                return [{"role": "user", "content": 7}], 0.0, False, {}
            return [{"role": "user", "content": "higher"}], float("nan"), False, {}
        return super().step(action_text)


def _row_truth_env():
    """skyrl-gym's multi-turn GSM8K environment, subclassed so that a launch can see what it was constructed with
    (defined lazily: skyrl-gym is the optional ``asyncppo[envs]`` dependency)."""
    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv  # optional: skyrl-gym

    class RowTruthEnv(GSM8kMultiTurnEnv):
        """GSM8K's turns, replies and rewards unchanged, plus ``env_config.truth_bonus`` x the row's ground truth
        at the episode's last turn: a run's rewards then show that every episode got its own row's extras (and
        ``env.text_env_config`` as a DictConfig). ``init`` checks that the prompt messages are its row's (the row's
        question names its ground truth): a mismatch raises, and its group is dropped."""

        def __init__(self, env_config=None, extras=None):
            super().__init__(env_config, extras)
            self.truth_bonus = float(env_config.truth_bonus)

        def init(self, prompt):
            if f"about {self.ground_truth}" not in prompt[-1]["content"]:
                raise RuntimeError(f"prompt {prompt!r:.80} is not the row of ground truth {self.ground_truth}")
            return super().init(prompt)

        def step(self, action: str):
            out = super().step(action)
            if out["done"]:
                out["reward"] += self.truth_bonus * float(self.ground_truth)
            return out

    return RowTruthEnv


def __getattr__(name: str):
    if name == "RowTruthEnv":
        return _row_truth_env()
    raise AttributeError(name)
