"""Text environments for tests of multi-turn launches, importable by the run's actors (tests/ on PYTHONPATH)."""

from __future__ import annotations

from asyncppo.envs.examples import GuessEnv


class FaultyGuessEnv(GuessEnv):
    """The guess game, except that a game whose hidden number is 0 raises at its second guess: with
    ``env.on_error=drop`` its whole group is dropped (and its admission ticket given back) while the run goes on."""

    def step(self, action_text: str):
        if self.target == 0 and self.turns == 1:
            raise RuntimeError("scripted fault: the environment broke at its second turn")
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
