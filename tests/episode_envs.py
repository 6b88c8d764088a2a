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
