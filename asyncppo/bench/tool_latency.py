"""``asyncppo bench tool-latency``: latency hiding on a multi-turn task, sync against async-continuous PPO while the
environment's tool is slow. ``agent=true`` plays the same game as an agent program through the OpenAI-compatible
endpoint instead (examples/agents/guess_latency.py: the same prompt, replies and rewards; the latency awaited by the
agent between its calls).

The guess game (``data=guess``) behind a tool that takes ``latency_s`` to answer every turn
(``asyncppo.envs.examples.ToolLatencyGuessEnv``: the step *awaits* the latency, the CPU stays free), launched in
each mode of ``modes`` at each latency, same seed, steps and trained samples (asyncppo/bench/launches.py). Per launch:
trained samples/s over learner time (all steps, and the steady last three quarters), engine occupancy, env wait
(the fraction of the learner's time the engine sat empty while episodes waited for their environment), turns per
episode; then each mode's throughput at every latency over its throughput at 0 ms: what an agent trainer must keep
when its tools are slow, and the figure the target is set on.
"""

from __future__ import annotations

import json
import os

from asyncppo.bench.launches import Launch, run_once

ENV = "env.text_env=asyncppo.envs.examples.ToolLatencyGuessEnv"
#: ``agent=true``: the same game as an agent program through the endpoint (examples/agents/guess_latency.py)
AGENT = "examples.agents.guess_latency:agent"


def episode_readout(run_dir: str, train_s: float) -> dict:
    """What the episode metrics add: env wait over learner time, mean turns, env seconds per call."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if "reward/mean" in r]
    wait = sum(r.get("episodes/env_wait_s", 0.0) for r in train)
    # steady state, as the busy fractions: the first quarter of the steps (engine load, the pipeline filling with
    # whole episodes, which latency lengthens) left out
    first = len(train) // 4
    steady = train[first:]
    before = train[first - 1]["samples_trained"] if first else 0

    def steady_mean(key: str) -> float:
        vals = [r[key] for r in steady if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    return {"at_env": steady_mean("episodes/at_env_mean"), "in_engine": steady_mean("episodes/in_engine_mean"),
            "groups": steady_mean("episodes/groups_mean"), "buffered": steady_mean("buffer/size"),
            "steady_per_s": (train[-1]["samples_trained"] - before) / sum(r["time/step_s"] for r in steady),
            "env_wait": wait / train_s if train_s else float("nan"),
            "turns_mean": sum(r.get("episodes/turns_mean", 0.0) for r in train) / max(len(train), 1),
            "env_s_per_call": sum(r.get("episodes/env_s_per_step", 0.0) for r in train) / max(len(train), 1)}


def run(opts: dict, seed: int, work: str) -> dict:
    model = opts["model"]
    if not model:
        from asyncppo.envs.examples import build_chat_model  # heavy: torch, transformers

        model = build_chat_model(os.path.join(work, "chat-model"))
    results, figures, units = [], {}, {}
    for mode in opts["modes"]:
        for ms in opts["latencies_ms"]:
            played = ["env.text_env=null", f"env.agent={AGENT}"] if opts["agent"] else [ENV]
            launch = Launch(steps=opts["steps"], staleness=opts["staleness"], lookahead=opts["lookahead"],
                            rollout_cpus=opts["rollout_cpus"], learner_cpus=opts["learner_cpus"],
                            preset=["data=guess", f"model.path={model}", *played],
                            overrides=[f"+env.text_env_config.latency_s={ms / 1000}", *opts["overrides"],
                                       f"trainer.seed={seed}"])
            r = run_once(f"{mode}-{ms}ms", launch, work, mode=mode)
            r.update(episode_readout(r["run_dir"], r["train_s"]), mode=mode, ms=ms)
            results.append(r)
            for key, name, unit in (("samples_per_s", "samples/s", "samples/s"),
                                    ("steady_per_s", "steady samples/s", "samples/s"),
                                    ("env_wait", "env wait", "fraction"), ("occupancy", "occupancy", "fraction")):
                figures[f"{name} {mode} {ms} ms"], units[f"{name} {mode} {ms} ms"] = r[key], unit
            print(f"[tool-latency] {mode} {ms} ms: {r['samples_per_s']:.1f} samples/s, env wait "
                  f"{r['env_wait']:.2f}", flush=True)
    for mode in opts["modes"]:
        own = {r["ms"]: r for r in results if r["mode"] == mode}
        for ms in [m for m in own if m and 0 in own]:
            for key, name in (("samples_per_s", "kept"), ("steady_per_s", "kept steady")):
                fig = f"{name} {mode} {ms} ms"
                figures[fig], units[fig] = own[ms][key] / own[0][key], "ratio"
                print(f"[tool-latency] {fig}: {figures[fig]:.2f}", flush=True)
    return {"figures": figures, "units": units, "detail": {"launches": results}}
