"""The guess game's warm-start transcripts (``data=guess``): find a hidden digit from ``higher`` / ``lower`` replies.

Why here: the built-in chat model of the game (``builtin:tiny-guess``) is built and warm-started by data/, which
may not import envs/; the game's texts are defined here and :class:`asyncppo.envs.examples.GuessEnv` plays them.
The transcripts mix two players: *halving* (guess the middle of what the replies left: always solved within 4
guesses on 0-9) and *ignoring* (distinct random digits whatever the replies say: solved within 4 guesses 40% of
the time). The share of halving games sets where the starting policy stands; reinforcement learning rewards the
halving moves, which solve more games in fewer turns.
"""

from __future__ import annotations

import random

from .calculator import transcript_segments
from .splits import TaskSplits

HIGH, MAX_GUESSES = 9, 4
PROMPT = "Guess my number, 0 to {high}."
HIGHER, LOWER, SAY_A_NUMBER = "higher", "lower", "Say a number."


def halving_guesses(target: int, high: int = HIGH) -> list[int]:
    """The guesses of the halving player until it finds ``target``."""
    lo, hi, guesses = 0, high, []
    while True:
        guess = (lo + hi) // 2
        guesses.append(guess)
        if guess == target:
            return guesses
        lo, hi = (guess + 1, hi) if guess < target else (lo, guess - 1)


def game_messages(target: int, guesses: list[int], max_guesses: int = MAX_GUESSES, high: int = HIGH) -> list[dict]:
    """The conversation of one game as :class:`~asyncppo.envs.examples.GuessEnv` plays it (up to ``max_guesses``)."""
    messages = [{"role": "user", "content": PROMPT.format(high=high)}]
    for turn, guess in enumerate(guesses[:max_guesses], start=1):
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == target or turn == max_guesses:
            break
        messages.append({"role": "user", "content": HIGHER if guess < target else LOWER})
    return messages


class GuessTask:
    """The game's rows (one per game: the hidden digit as the answer) and warm-start transcripts; registered as
    ``guess`` so that ``builtin:tiny-guess`` can be built. Every digit is a train and an eval game: the game has no
    held-out inputs, so its figure is the success rate over all ten digits."""

    name = "guess"
    default_reward = "exact_match"
    multi_turn = True

    def __init__(self, seed: int = 0, num_eval: int = 10):
        self.seed, self.num_eval = seed, num_eval

    def splits(self) -> TaskSplits:
        rows = [{"prompt": PROMPT.format(high=HIGH), "answer": str(t), "target": t} for t in range(HIGH + 1)]
        return TaskSplits(train=rows, eval=rows[: self.num_eval])

    def alphabet(self) -> str:
        return "\n" + "".join(map(chr, range(32, 127)))

    @property
    def max_response_tokens(self) -> int:
        return 2

    def warmstart_transcripts(self, tokenizer, count: int, rng: random.Random, tool_share: float,
                              with_tools: bool = True) -> list[list[tuple[str, bool]]]:
        """``count`` games with random targets, a ``tool_share`` of them (the name the calculator gives its share of
        the path that works) played by halving, the rest by ignoring; ``with_tools`` is ignored (no tools)."""
        out = []
        for _ in range(count):
            target = rng.randint(0, HIGH)
            if rng.random() < tool_share:
                guesses = halving_guesses(target)
            else:
                guesses = rng.sample(range(HIGH + 1), MAX_GUESSES)
            out.append(transcript_segments(tokenizer, game_messages(target, guesses), None))
        return out
