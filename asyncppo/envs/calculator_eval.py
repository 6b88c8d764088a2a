"""Held-out success of a model on ``data=calculator``: whole episodes (tool call, tool result, answer) on rows the
run never trains on, through the same episode loop as training (:mod:`asyncppo.envs.episode_eval`).

Why its own measurement: the run's held-out evaluation is single-turn (docs/environments.md), and a calculator
answer without its tool turn measures the wrong thing. So the task's start and end figures are measured here, on
the warm-started model and on the run's ``final/`` weights, with the same rows, seeds and sampling both times:
the two figures differ by the weights alone. ``python -m asyncppo.envs.calculator_eval MODEL [MODEL ...]``
(``--task guess``: the guess game's success over its ten digits, :func:`guess_success`).
"""

from __future__ import annotations

import argparse
import json

from asyncppo.data.tasks import get_task
from asyncppo.envs.calculator import CalculatorEnv
from asyncppo.envs.episode_eval import EpisodeLimits, episode_success

#: The episode limits of configs/data/calculator.yaml (a call, the result, the answer; one spare turn).
CALCULATOR_LIMITS = EpisodeLimits(max_turns=3, response_length=192, turn_max_tokens=64, prompt_tokens=288)
#: The episode limits of configs/data/guess.yaml.
GUESS_LIMITS = EpisodeLimits(max_turns=4, response_length=128, turn_max_tokens=4, prompt_tokens=64)


def heldout_success(model_path: str, *, rows: int = 200, samples: int = 4, temperature: float = 1.0,
                    seed: int = 0, task_seed: int = 0, engine: str = "hf") -> dict:
    """Success rates over ``rows`` held-out rows: ``success_sampled`` (``samples`` episodes per row at
    ``temperature``, seeded per row), ``success_greedy`` (one greedy episode per row), and ``tool_use_sampled``
    (the fraction of sampled episodes that made at least one well-formed call)."""
    path = _resolve(model_path, "data=calculator")
    held = get_task("calculator", seed=task_seed).held_out()[:rows]
    games = [({"prompt": r["prompt"], "answer": r["answer"], "index": i}, [{"role": "user", "content": r["prompt"]}])
             for i, r in enumerate(held)]
    out = episode_success(path, CalculatorEnv, games, CALCULATOR_LIMITS, samples=samples, temperature=temperature,
                          seed=seed, engine=engine)
    sampled = out.pop("envs")["sampled"]
    out["tool_use_sampled"] = sum(e.tool_calls > 0 for e in sampled) / max(1, len(sampled))
    return {"model": model_path, "rows": len(held), **out}


def guess_success(model_path: str, *, rounds: int = 10, samples: int = 4, temperature: float = 1.0,
                  seed: int = 0, engine: str = "hf") -> dict:
    """The guess game's success (solved within its 4 guesses) over ``rounds`` games of each of the ten digits."""
    from asyncppo.envs.examples import GuessEnv

    path = _resolve(model_path, "data=guess")
    games = [({"target": t}, []) for _ in range(rounds) for t in range(10)]
    out = episode_success(path, GuessEnv, games, GUESS_LIMITS, samples=samples, temperature=temperature, seed=seed,
                          engine=engine)
    sampled = out.pop("envs")["sampled"]
    out["turns_sampled"] = sum(e.turns for e in sampled) / max(1, len(sampled))
    return {"model": model_path, **out}


def _resolve(model_path: str, preset: str) -> str:
    """A ``builtin:`` model as the task's preset builds it (its ``trainer.sft_warmup_steps`` is part of the cache
    key), so that ``builtin:tiny-calculator`` names the very model a run of the task starts from."""
    if not model_path.startswith("builtin:"):
        return model_path
    from asyncppo.config.loader import load_config  # Hydra compose: only for a builtin: path
    from asyncppo.data.tiny import model_of  # heavy: torch (builds the model when it is not cached)

    cfg = load_config(overrides=[preset])
    return model_of(cfg, model_path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="model directories (a run's final/) or builtin:tiny-calculator")
    p.add_argument("--task", default="calculator", choices=["calculator", "guess"])
    p.add_argument("--rows", type=int, default=200, help="calculator: held-out rows; guess: games per digit")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    args = p.parse_args(argv)
    for model in args.models:
        if args.task == "guess":
            out = guess_success(model, rounds=args.rows, samples=args.samples, engine=args.engine)
        else:
            out = heldout_success(model, rows=args.rows, samples=args.samples, engine=args.engine)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
