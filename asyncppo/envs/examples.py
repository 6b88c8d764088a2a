"""Built-in scripted text environments, for tests and demos of multi-turn runs (docs/environments.md).

Why here: a launch with ``env.text_env`` needs an environment that is small, deterministic and needs nothing
installed, so that the whole path (worker, engine, learner, metrics) can be exercised on two CPU cores.
:class:`GuessEnv` is the ``data=guess`` game: the environment holds a hidden digit and answers each guess with
``higher`` or ``lower``; solving it within the turn limit earns a reward that is larger for fewer turns.
:class:`ToolLatencyGuessEnv` is the same game behind a slow tool: its ``step`` awaits ``latency_s`` before it
answers, which is what the latency-hiding benchmark (``asyncppo bench tool-latency``) varies.

:func:`build_chat_model` writes a randomly initialised tiny Qwen2 over the local chat tokenizer
(:func:`asyncppo.envs.chat.build_chat_tokenizer`, which carries a Qwen-style chat template) so that such a run
needs no download: ``python -m asyncppo.envs.examples DIR``.
"""

from __future__ import annotations

import asyncio
import math
import re
import sys
import zlib
from typing import Mapping, Optional

from asyncppo.envs.text_env import TextEnv

_NUMBER = re.compile(r"\d+")


class GuessEnv(TextEnv):
    """Guess a hidden number in ``[0, high]`` from ``higher`` / ``lower`` replies.

    The hidden number is ``extras["target"]`` when the dataset row carries one, else a hash of the row's prompt
    and index, so the ``n`` episodes of one group play the same game. Rewards: ``1 - (turn - 1) / max_guesses``
    for a right guess at ``turn`` (1.0 at the first), 0 otherwise; a turn without a number is answered with the
    rules. ``env_config`` may set ``high`` and ``max_guesses``."""

    def __init__(self, env_config: Optional[Mapping] = None, extras: Optional[Mapping] = None):
        super().__init__(env_config, extras)
        config = dict(env_config or {})
        self.high = int(config.get("high", 9))
        self.max_guesses = int(config.get("max_guesses", 4))
        if "target" in self.extras:
            self.target = int(self.extras["target"])
        else:
            seed = f"{self.extras.get('prompt', '')}|{self.extras.get('index', 0)}".encode()
            self.target = zlib.crc32(seed) % (self.high + 1)
        self.turns = 0

    def init(self, prompt_messages: list) -> tuple[list, dict]:
        return [{"role": "user", "content": f"Guess my number, 0 to {self.high}."}], {}

    def step(self, action_text: str):
        self.turns += 1
        found = _NUMBER.search(action_text)
        if found is None:
            reply = "Say a number."
        elif int(found.group()) == self.target:
            return [], 1.0 - (self.turns - 1) / self.max_guesses, True, {"solved": True}
        else:
            reply = "higher" if int(found.group()) < self.target else "lower"
        done = self.turns >= self.max_guesses
        return ([] if done else [{"role": "user", "content": reply}]), 0.0, done, {"solved": False}


class ToolLatencyGuessEnv(GuessEnv):
    """:class:`GuessEnv` whose every answer takes ``env_config["latency_s"]`` seconds (default 0), spent *awaiting*
    (``asyncio.sleep``), as a call to a remote tool or sandbox would: the process's CPU stays free meanwhile, so
    what a run loses to the latency is waiting, not work. ``step`` is a coroutine function, which the runner runs to
    completion on one of its ``env.max_concurrency`` pool threads under ``env.step_timeout_s``
    (:mod:`asyncppo.envs.env_runner`)."""

    def __init__(self, env_config: Optional[Mapping] = None, extras: Optional[Mapping] = None):
        super().__init__(env_config, extras)
        latency = float(dict(env_config or {}).get("latency_s", 0.0))
        if not (math.isfinite(latency) and latency >= 0):
            raise ValueError(f"env.text_env_config.latency_s={latency!r}: must be a finite number of seconds >= 0")
        self.latency_s = latency

    async def step(self, action_text: str):
        await asyncio.sleep(self.latency_s)
        return GuessEnv.step(self, action_text)


def build_chat_model(out_dir: str, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> str:
    """A random fp32 tiny Qwen2 with the chat tokenizer, written to ``out_dir`` (what a multi-turn demo or test
    launches with ``model.path=out_dir``); untied embeddings and head_dim 32, which vLLM's CPU backend supports."""
    import torch  # heavy: torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # heavy: transformers

    from asyncppo.envs.chat import build_chat_tokenizer

    tok = build_chat_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32,
                         head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                         use_sliding_window=False, rope_theta=10000.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    # no sampling defaults: vLLM and transformers would otherwise apply them silently
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=tok.bos_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return str(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m asyncppo.envs.examples OUT_DIR  (writes a tiny chat model for data=guess)")
    print(build_chat_model(sys.argv[1]))
