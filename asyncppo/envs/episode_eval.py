"""Success rates of whole episodes of a text environment, measured outside a run on a model directory.

Why: the run's held-out evaluation is single-turn (docs/environments.md), and a multi-turn task's success is a
property of whole episodes. :func:`episode_success` plays the given games through the training episode loop
(:class:`~asyncppo.envs.episodes.EpisodeEngine`, the transformers engine by default): ``samples`` seeded episodes
per game at ``temperature`` and one greedy, the same games and seeds for every model, so two models' figures
differ by their weights alone. The built-in tasks' commands: ``python -m asyncppo.envs.calculator_eval``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.episodes import EpisodeEngine
from asyncppo.envs.text_env import make_text_env
from asyncppo.rollout.engine import SamplingSpec


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    response_length: int
    turn_max_tokens: int
    prompt_tokens: int


def episode_success(model_dir: str, env_class: type, games: list[tuple[dict, list]], limits: EpisodeLimits, *,
                    samples: int = 4, temperature: float = 1.0, seed: int = 0, engine: str = "hf") -> dict:
    """``success_sampled`` / ``success_greedy``: the fraction of episodes whose reward is positive, over
    ``samples`` sampled episodes and one greedy episode per game (``(extras, prompt_messages)``), plus
    ``reward_sampled`` (the mean reward) and the environments (``envs``: kind -> list) for task-specific counts."""
    from transformers import AutoTokenizer  # heavy: transformers

    from asyncppo.rollout.engines import make_engine  # heavy: torch, transformers

    eng = make_engine(engine, model_dir, dtype="float32", max_model_len=limits.prompt_tokens + limits.response_length,
                      seed=seed, num_threads=1, kv_cache_gib=1, max_num_seqs=256)
    t0 = time.time()
    envs: dict[str, list[Any]] = {"greedy": [], "sampled": []}
    rewards: dict[str, list[float]] = {"greedy": [], "sampled": []}
    with EnvRunner(max_concurrency=4, step_timeout_s=30) as runner:
        episodes = EpisodeEngine(eng, AutoTokenizer.from_pretrained(model_dir), runner, max_turns=limits.max_turns,
                                 response_length=limits.response_length, turn_max_tokens=limits.turn_max_tokens)
        for i, (extras, prompt_messages) in enumerate(games):
            for kind, spec in (("greedy", SamplingSpec(n=1, max_tokens=limits.response_length, temperature=0.0)),
                               ("sampled", SamplingSpec(n=samples, max_tokens=limits.response_length,
                                                        temperature=temperature, seed=seed + 7919 * i))):
                group = [make_text_env(env_class, extras, {}, max_turns=limits.max_turns) for _ in range(spec.n)]
                envs[kind] += group
                episodes.add_group(f"{kind}:{i}", None, spec, group, prompt_messages=list(prompt_messages))
        while episodes.num_unfinished_seqs():
            for group in episodes.step():
                rewards[group.key.split(":")[0]] += [c.reward for c in group.completions]
        episodes.close()
    return {"games": len(games), "samples": samples, "temperature": temperature,
            "success_sampled": _rate([r > 0 for r in rewards["sampled"]]),
            "success_greedy": _rate([r > 0 for r in rewards["greedy"]]),
            "reward_sampled": _rate(rewards["sampled"]), "envs": envs, "seconds": round(time.time() - t0, 1)}


def _rate(values: list) -> float:
    return float(sum(values)) / max(1, len(values))
