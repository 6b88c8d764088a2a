"""``asyncppo bench agent-overhead``: what the HTTP path costs an agent against the in-process episode loop.

The same calculator episodes played two ways on one vLLM engine (the warm-started ``builtin:tiny-calculator``,
prefix caching on), in one process as in a rollout worker:

* ``in-process``: :class:`asyncppo.envs.calculator.CalculatorEnv`, called by the episode loop on its runner;
* ``endpoint``: ``examples/agents/calculator_openai.py``, a plain OpenAI-client loop, through the worker's
  aiohttp endpoint (:mod:`asyncppo.agents`), its client on the server's event loop.

Both render the same prompt and the same tool turns, and both sample with the same per-episode seeds, so they
generate the same episodes (up to a reply whose tool call does not parse, which the environment answers with an
error and the agent reads as its answer): the paired difference is the path. Per path, ``rounds`` alternating
rounds of ``rows`` held-out rows x ``n`` episodes, all added at once (the prefix cache emptied before each): episodes per second (the median round), and the
per-call time (an environment ``step``: the in-process call, or the round trip from the model's reply to the
agent's next call) at p50 and p99 over every call of every round. Also: the fraction of episodes whose token ids
are the same on both paths.
"""

from __future__ import annotations

import statistics
import time

from asyncppo.agents.episode import AgentEpisode
from asyncppo.agents.server import AgentServer
from asyncppo.envs.calculator import CalculatorEnv
from asyncppo.envs.calculator_eval import CALCULATOR_LIMITS, _resolve
from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.episodes import EpisodeEngine
from asyncppo.envs.text_env import make_text_env
from asyncppo.rollout.engine import SamplingSpec

AGENT = "examples.agents.calculator_openai:agent"


def _play(engine, tok, episodes_of, rows: list, n: int, seed: int) -> tuple[float, list, dict]:
    """Play ``n`` episodes of every row at once; (seconds, per-call seconds, key -> [token ids per episode])."""
    lim = CALCULATOR_LIMITS
    reset = getattr(getattr(engine, "llm", None), "reset_prefix_cache", None)
    if reset is not None:
        reset()  # the other path played these prompts: neither starts with them cached
    with EnvRunner(max_concurrency=len(rows) * n, step_timeout_s=60, on_error="zero_reward") as runner:
        loop = EpisodeEngine(engine, tok, runner, max_turns=lim.max_turns, response_length=lim.response_length,
                             turn_max_tokens=lim.turn_max_tokens, max_prompt_tokens=lim.prompt_tokens)
        t0 = time.perf_counter()
        for i, row in enumerate(rows):
            spec = SamplingSpec(n=n, max_tokens=lim.response_length, temperature=1.0, seed=seed * 1_000_003 + i * n)
            loop.add_group(f"g{i}", None, spec, episodes_of(row, n),
                           prompt_messages=[{"role": "user", "content": row["prompt"]}])
        ids: dict = {}
        while len(ids) < len(rows):
            for group in loop.step():
                ids[group.key] = [list(map(int, c.token_ids)) for c in group.completions]
            if not loop.num_running_seqs():
                time.sleep(0.001)
        seconds = time.perf_counter() - t0
        return seconds, list(runner.step_durations), ids


def _pct(values: list, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000.0 if values else float("nan")


def run(opts: dict, seed: int, work: str) -> dict:
    from transformers import AutoTokenizer  # heavy: transformers

    from asyncppo.data.tasks import get_task
    from asyncppo.rollout.engines import make_engine  # heavy: torch, vllm

    path = _resolve(opts["model"], "data=calculator")
    tok = AutoTokenizer.from_pretrained(path)
    lim = CALCULATOR_LIMITS
    engine = make_engine(opts["engine"], path, dtype="float32", max_model_len=lim.prompt_tokens + lim.response_length,
                         seed=seed, kv_cache_gib=1, max_num_seqs=256, enable_prefix_caching=True, block_size=32)
    server = AgentServer(AGENT, model_name="tiny",
                         max_concurrency=opts["rows"] * opts["n"]).start()
    held = get_task("calculator", seed=0).held_out()
    paths = {
        "in-process": lambda row, n: [make_text_env(CalculatorEnv, row, {}, max_turns=lim.max_turns)
                                      for _ in range(n)],
        "endpoint": lambda row, n: [AgentEpisode(server, row, wait_s=65, tokenizer=tok) for _ in range(n)],
    }
    rate: dict = {k: [] for k in paths}
    calls: dict = {k: [] for k in paths}
    same = total = 0
    try:
        for r in range(opts["rounds"]):
            chunk = held[r * opts["rows"]: (r + 1) * opts["rows"]]
            rows = [{"prompt": x["prompt"], "answer": x["answer"], "index": i} for i, x in enumerate(chunk)]
            got = {}
            order = list(paths) if r % 2 == 0 else list(reversed(paths))  # alternate: neither path always goes first
            for kind in order:
                seconds, durations, got[kind] = _play(engine, tok, paths[kind], rows, opts["n"], seed + r)
                rate[kind].append(len(rows) * opts["n"] / seconds)
                calls[kind] += durations
                print(f"[bench] round {r} {kind}: {rate[kind][-1]:.1f} episodes/s, {len(durations)} calls", flush=True)
            for key in got["in-process"]:
                for a, b in zip(got["in-process"][key], got["endpoint"][key]):
                    same += a == b
                    total += 1
    finally:
        server.close()
        engine.close()
    eps = {k: statistics.median(v) for k, v in rate.items()}
    figures = {
        "episodes/s in-process": eps["in-process"], "episodes/s endpoint": eps["endpoint"],
        "throughput endpoint / in-process": eps["endpoint"] / eps["in-process"],
        "per-call ms p50 in-process": _pct(calls["in-process"], 0.5),
        "per-call ms p99 in-process": _pct(calls["in-process"], 0.99),
        "per-call ms p50 endpoint": _pct(calls["endpoint"], 0.5),
        "per-call ms p99 endpoint": _pct(calls["endpoint"], 0.99),
        "episodes identical on both paths": same / max(1, total),
    }
    units = {k: ("episodes/s" if "episodes/s" in k else "ms" if "ms" in k else "ratio") for k in figures}
    return {"figures": figures, "units": units,
            "detail": {"rounds": {k: [round(x, 2) for x in v] for k, v in rate.items()},
                       "calls": {k: len(v) for k, v in calls.items()}, "episodes_compared": total}}
