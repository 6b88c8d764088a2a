#!/usr/bin/env python
"""Latency hiding on a multi-turn task: sync against async-continuous PPO while the environment's tool is slow.

The guess game (``data=guess``) behind a tool that takes ``latency_s`` to answer every turn
(``asyncppo.envs.examples.ToolLatencyGuessEnv``: the step *awaits* the latency, the CPU stays free), run with
``sync`` and ``async-cont`` of scripts/bench_async_vs_sync.py at each latency, same seed, steps and trained samples.
For each run it prints trained samples/s (over learner time: all steps, and the steady last three quarters),
engine occupancy, env wait (the fraction of the learner's time the engine sat empty while episodes waited for
their environment, ``episodes/env_wait_s``), rollout and train busy fractions and turns per episode; then each
mode's throughput at every latency over its throughput at 0.

    python scripts/bench_tool_latency.py --steps 30 rollout.rollout_batch_size=4 rollout.max_num_seqs=64 \
        algorithm.use_kl_loss=false env.max_concurrency=128
    python scripts/bench_tool_latency.py --modes async-cont --staleness 8 --latencies 0,200 env.max_concurrency=128
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_async_vs_sync import run_once, save_results  # noqa: E402  (a sibling script: the same launch and read-out)

ENV = "env.text_env=asyncppo.envs.examples.ToolLatencyGuessEnv"

ROWS = [
    ("trained samples / s, all steps", "samples_per_s", "{:.1f}"),
    ("trained samples / s, steady (last 3/4 of the steps)", "steady_per_s", "{:.1f}"),
    ("learner time (s)", "train_s", "{:.1f}"),
    ("engine occupancy", "occupancy", "{:.2f}"),
    ("env wait", "env_wait", "{:.2f}"),
    ("rollout busy", "rollout_busy", "{:.2f}"),
    ("train busy", "train_busy", "{:.2f}"),
    ("turns per episode", "turns_mean", "{:.2f}"),
    ("env seconds per call (init, step, close)", "env_s_per_call", "{:.3f}"),
    ("lag max", "lag_max", "{:.0f}"),
    ("episodes at their environment (mean, steady)", "at_env", "{:.0f}"),
    ("episodes in the engine (mean, steady)", "in_engine", "{:.0f}"),
    ("groups in flight on the worker (mean, steady)", "groups", "{:.1f}"),
    ("groups in the learner's buffer (mean, steady)", "buffered", "{:.1f}"),
    ("load average (1 min) at the run's end", "load_end", "{:.1f}"),
]


def episode_readout(run_dir: str, train_s: float) -> dict:
    """What the episode metrics add: env wait over learner time, mean turns, env seconds per call."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
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


def parser() -> argparse.ArgumentParser:
    """The command line; its namespace is what ``run_once`` of bench_async_vs_sync.py reads, plus the latencies."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--lookahead", type=int, default=1, help="rollout.admission_lookahead of the async-cont-lookahead mode")
    p.add_argument("--eval-at-start", action="store_true", help="evaluate the starting weights in every launch too")
    p.add_argument("--modes", default="sync,async-cont")
    p.add_argument("--latencies", default="0,50,200", help="tool latencies in milliseconds")
    p.add_argument("--model", default="", help="a chat model directory (default: the local tiny one, built here)")
    p.add_argument("--rollout-cpus", default="1")
    p.add_argument("--learner-cpus", default="0")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    return p


def main() -> None:
    args = parser().parse_args()
    root = tempfile.mkdtemp(prefix="asyncppo-latency-")
    model = args.model
    if not model:
        from asyncppo.envs.examples import build_chat_model  # heavy: torch, transformers

        model = build_chat_model(os.path.join(root, "chat-model"))
    modes = [m for m in args.modes.split(",") if m]
    latencies = [int(x) for x in args.latencies.split(",") if x]
    results = []
    for mode in modes:
        for ms in latencies:
            run = copy.copy(args)
            run.preset = ["data=guess", f"model.path={model}", ENV]
            run.overrides = [f"+env.text_env_config.latency_s={ms / 1000}", *args.overrides]
            label = f"{mode}-{ms}ms"
            r = run_once(label, run, root, mode=mode)
            r.update(episode_readout(r["run_dir"], r["train_s"]), mode=mode, ms=ms,
                     load_end=os.getloadavg()[0])  # the box is shared: say how loaded it was
            results.append(r)
            print(f"[bench] {label}: {r['samples_per_s']:.1f} samples/s, env wait {r['env_wait']:.2f}", flush=True)
    print()
    print("| metric | " + " | ".join(f"{r['mode']} {r['ms']} ms" for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for name, key, fmt in ROWS:
        print(f"| {name} | " + " | ".join(fmt.format(r[key]) for r in results) + " |")
    for mode in modes:
        own = {r["ms"]: r for r in results if r["mode"] == mode}
        if 0 in own:
            for ms in latencies[1:]:
                print(f"{mode}: throughput at {ms} ms / at 0 ms = "
                      f"{own[ms]['samples_per_s'] / own[0]['samples_per_s']:.2f} (all steps), "
                      f"{own[ms]['steady_per_s'] / own[0]['steady_per_s']:.2f} (steady)")
    save_results(results, root)


if __name__ == "__main__":
    main()
