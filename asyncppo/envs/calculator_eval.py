"""Held-out success of a model on ``data=calculator``: whole episodes (tool call, tool result, answer) on rows the
run never trains on, through the same episode loop as training (:class:`~asyncppo.envs.episodes.EpisodeEngine`).

Why its own measurement: the run's held-out evaluation is single-turn (docs/environments.md), and a calculator
answer without its tool turn measures the wrong thing. So the task's start and end figures are measured here, on
the warm-started model and on the run's ``final/`` weights, with the same rows, seeds and sampling both times:
the two figures differ by the weights alone. ``python -m asyncppo.envs.calculator_eval MODEL [MODEL ...]``.
"""

from __future__ import annotations

import argparse
import json
import time

from asyncppo.data.tasks import get_task
from asyncppo.envs.calculator import CalculatorEnv
from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.episodes import EpisodeEngine
from asyncppo.envs.text_env import make_text_env
from asyncppo.rollout.engine import SamplingSpec

#: The episode limits of configs/data/calculator.yaml (a call, the result, the answer; one spare turn).
MAX_TURNS, RESPONSE_LENGTH, TURN_MAX_TOKENS, PROMPT_TOKENS = 3, 192, 64, 288


def heldout_success(model_path: str, *, rows: int = 200, samples: int = 4, temperature: float = 1.0,
                    seed: int = 0, task_seed: int = 0, engine: str = "hf") -> dict:
    """Success rates over ``rows`` held-out rows: ``success_sampled`` (``samples`` episodes per row at
    ``temperature``, seeded per row), ``success_greedy`` (one greedy episode per row), and ``tool_use_sampled``
    (the fraction of sampled episodes that made at least one well-formed call)."""
    from asyncppo.data.tiny import resolve_model_path  # heavy: torch (builds builtin:tiny-calculator when asked)
    from asyncppo.rollout.engines import make_engine  # heavy: torch, transformers

    path = resolve_model_path(model_path, sft_steps=_task_sft_steps()) if model_path.startswith("builtin:") \
        else model_path
    held = get_task("calculator", seed=task_seed).held_out()[:rows]
    eng = make_engine(engine, path, dtype="float32", max_model_len=PROMPT_TOKENS + RESPONSE_LENGTH, seed=seed,
                      num_threads=1, kv_cache_gib=1, max_num_seqs=256)
    t0 = time.time()
    envs: dict[str, list] = {}
    with EnvRunner(max_concurrency=4, step_timeout_s=30) as runner:
        episodes = EpisodeEngine(eng, _tokenizer(path), runner,
                                 max_turns=MAX_TURNS, response_length=RESPONSE_LENGTH,
                                 turn_max_tokens=TURN_MAX_TOKENS)
        for i, row in enumerate(held):
            extras = {"prompt": row["prompt"], "answer": row["answer"], "index": i}
            for kind, spec in (("greedy", SamplingSpec(n=1, max_tokens=RESPONSE_LENGTH, temperature=0.0)),
                               ("sampled", SamplingSpec(n=samples, max_tokens=RESPONSE_LENGTH,
                                                        temperature=temperature, seed=seed + 7919 * i))):
                key = f"{kind}:{i}"
                envs[key] = [make_text_env(CalculatorEnv, extras, {}, max_turns=MAX_TURNS) for _ in range(spec.n)]
                episodes.add_group(key, None, spec, envs[key], prompt_messages=[{"role": "user",
                                                                                 "content": row["prompt"]}])
        rewards: dict[str, list] = {"greedy": [], "sampled": []}
        while episodes.num_unfinished_seqs():
            for group in episodes.step():
                rewards[group.key.split(":")[0]] += [c.reward for c in group.completions]
        episodes.close()
    sampled_envs = [e for key, group in envs.items() if key.startswith("sampled") for e in group]
    return {"model": model_path, "rows": len(held), "samples": samples, "temperature": temperature,
            "success_sampled": sum(rewards["sampled"]) / max(1, len(rewards["sampled"])),
            "success_greedy": sum(rewards["greedy"]) / max(1, len(rewards["greedy"])),
            "tool_use_sampled": sum(e.tool_calls > 0 for e in sampled_envs) / max(1, len(sampled_envs)),
            "seconds": round(time.time() - t0, 1)}


def _task_sft_steps() -> int:
    """The warm-start length ``data=calculator`` builds its model with (configs/data/calculator.yaml), so that
    ``builtin:tiny-calculator`` names the very model a run of the task starts from (the cache key covers it)."""
    from asyncppo.config.loader import load_config  # Hydra compose: only for a builtin: path

    return load_config(overrides=["data=calculator"]).trainer.sft_warmup_steps


def _tokenizer(path: str):
    from transformers import AutoTokenizer  # heavy: transformers

    return AutoTokenizer.from_pretrained(path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="model directories (a run's final/) or builtin:tiny-calculator")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    args = p.parse_args(argv)
    for model in args.models:
        print(json.dumps(heldout_success(model, rows=args.rows, samples=args.samples, engine=args.engine)),
              flush=True)


if __name__ == "__main__":
    main()
