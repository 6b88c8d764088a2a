"""The guess game's warm-start transcripts (data/guess.py) are the conversations GuessEnv plays."""

from __future__ import annotations

import random

from asyncppo.data.guess import MAX_GUESSES, GuessTask, game_messages, halving_guesses
from asyncppo.envs.examples import GuessEnv


def _play(target: int, guesses: list[int]) -> tuple[list, float]:
    env = GuessEnv({}, {"target": target})
    messages, _ = env.init([])
    reward = 0.0
    for guess in guesses:
        messages.append({"role": "assistant", "content": str(guess)})
        obs, reward, done, _ = env.step(str(guess))
        messages += obs
        if done:
            break
    return messages, reward


def test_halving_solves_every_digit_within_the_limit_and_transcripts_match_the_environment():
    for target in range(10):
        guesses = halving_guesses(target)
        assert guesses[-1] == target and len(guesses) <= MAX_GUESSES
        messages, reward = _play(target, guesses)
        assert messages == game_messages(target, guesses) and reward == 1 - (len(guesses) - 1) / MAX_GUESSES
    rng = random.Random(0)
    for target in range(10):  # the ignoring player: the same texts, cut at the limit
        guesses = rng.sample(range(10), MAX_GUESSES)
        assert _play(target, guesses)[0] == game_messages(target, guesses)


def test_warmstart_transcripts_train_the_guesses_only():
    from asyncppo.data.chat_tokenizer import TINY_TOOLS_TEMPLATE, build_chat_tokenizer

    tok = build_chat_tokenizer(template=TINY_TOOLS_TEMPLATE)
    transcripts = GuessTask().warmstart_transcripts(tok, 50, random.Random(1), tool_share=1.0)
    for segments in transcripts:
        trained = [text for text, on in segments if on]
        assert all(t[:-len("<|im_end|>")].isdigit() for t in trained) and 1 <= len(trained) <= MAX_GUESSES
