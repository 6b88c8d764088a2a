"""One ``asyncppo launch`` as a benchmark measurement, and what its run directory says afterwards.

Shared by the benchmarks that compare schedules on real launches (async-vs-sync, the limit, tool latency): each
launch runs as its own process (the way a user runs it), pinned like disjoint GPU pools would be (the engine's
cores and the learner's, launch/actors.py), and is read back from its ``metrics.jsonl`` and ``summary.json``, so
the benchmark measures exactly what a user's run records. A schedule (``sync``, ``async-batch``, ``async-cont``,
``async-cont-lookahead``) is the overrides of asyncppo/config/schedules.py; a mode may carry overrides of its own
after ``+`` (``async-cont-lookahead+rollout.sync_every=2``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

from asyncppo.bench.limit import REPO, pinned_env
from asyncppo.config.schedules import SCHEDULES, schedule_overrides
from asyncppo.metrics.rollout import WAIT_KEYS

__all__ = ["Launch", "SCHEDULES", "run_once", "mean"]


@dataclass
class Launch:
    """What a schedule benchmark launches: the options every launch shares (``run_once`` reads exactly these)."""

    steps: int
    staleness: int | str  # a number, or "auto" (the run tunes it)
    lookahead: int | str = 1
    eval_at_start: bool = False
    replay: bool = False
    rollout_cpus: str = "1"
    learner_cpus: str = "0"
    preset: list = field(default_factory=list)
    overrides: list = field(default_factory=list)


def mean(key: str, rows: list[dict]) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def learner_s(steps: list[dict]) -> float:
    """The learner's time over ``steps`` (step records), as the benchmarks count it: each step's ``time/step_s`` and
    what an auto window's hook held its thread for between steps (``time/tune_s``: a decision made there once fell
    outside every step's time, pipeline/tuner_host.py)."""
    return sum(r["time/step_s"] + r.get("time/tune_s", 0.0) for r in steps)


def run_once(label: str, launch: Launch, root: str, mode: str = "") -> dict:
    """One launch in ``SCHEDULES[mode or label]``, its run directory ``root/label``; the figures read back."""
    base, *extra = (mode or label).split("+")
    if base not in SCHEDULES:
        raise ValueError(f"unknown mode {base!r}; allowed: {list(SCHEDULES)}")
    schedule = schedule_overrides(base, launch.staleness, launch.lookahead)
    out = os.path.join(root, re.sub(r"[^A-Za-z0-9_.-]+", "_", label))  # a Hydra value: no '=', '+' or '/'
    cmd = [
        sys.executable, "-m", "asyncppo", "launch", *launch.preset,
        f"trainer.output_dir={out}",
        f"trainer.total_steps={launch.steps}",
        "trainer.logger.wandb=false",
        "trainer.eval_every=0",
        # no point-0 evaluation unless asked: its round holds the engine at version 0 while the learner waits for
        # its first push, a one-time stall the limit does not include; the final one is untimed
        f"trainer.eval_at_start={'true' if launch.eval_at_start else 'false'}",
        *schedule,
        *(["trainer.save_trained_groups=true"] if launch.replay else []),
        *launch.overrides,
        *extra,  # the mode's own overrides, after the shared ones (they win)
    ]
    env = pinned_env(launch.rollout_cpus, launch.learner_cpus)
    print(f"[bench] {label}: {' '.join(cmd[3:])}", flush=True)
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-4000:])
        raise RuntimeError(f"[bench] {label} failed with exit code {proc.returncode}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    train = [r for r in records if "reward/mean" in r]
    steady = train[len(train) // 4 :]  # skip start-up (engine load, first batches)
    tune_s = sum(r.get("time/tune_s", 0.0) for r in train)
    train_s = learner_s(train)
    ro = summary.get("rollout", {})
    nan = float("nan")
    return {
        "label": label,
        "run_dir": out,
        "mode_overrides": [*schedule, *extra],  # what the learner alone needs to build this launch's learner
        "wall_s": wall,
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # others' work slows a run
        "train_s": train_s,
        "tune_s": tune_s,  # of train_s: the window hook on the learner's thread (0 for a fixed window)
        # train_s past the run's first tenth of steps: what a longer run's start would weigh less in (window_sweep)
        "train_s_late": learner_s(train[len(train) // 10:]),
        "update_s": sum(r.get("time/update_s", 0.0) for r in train),  # the PPO update itself
        "wait_s": sum(r.get("time/wait_s", 0.0) for r in train),  # waiting for the batch's groups
        "samples": train[-1]["samples_trained"],
        "samples_per_s": train[-1]["samples_trained"] / train_s,
        "occupancy": ro.get("occupancy", nan),
        "occupancy_steady": ro.get("occupancy_steady") if ro.get("occupancy_steady") is not None else nan,
        "running_mean": ro.get("running_mean", nan),
        "decode_tokens_per_s": ro.get("decode_tokens_per_s", nan),
        "rollout_busy": mean("util/rollout_busy", steady),
        "train_busy": mean("util/train_busy", steady),
        **{key: ro.get(key, nan) for key in WAIT_KEYS},  # engine empty / slots free, by cause
        "push_p50": ro.get("push_s_p50", nan),
        "push_p99": ro.get("push_s_p99", nan),
        "inflight_updates": ro.get("inflight_updates", 0),
        "waste": train[-1].get("waste/tokens_frac", 0.0),
        "len_mean": ro.get("response_length_mean", nan),
        "len_p99": ro.get("response_length_p99", nan),
        "reward_first": mean("reward/mean", train[:10]),
        "reward_last": mean("reward/mean", train[-10:]),
        "eval_before": summary.get("eval_before", {}).get("accuracy_sampled", nan),
        "eval_after": summary.get("eval_after", {}).get("accuracy_sampled", nan),
        "lag_mean": mean("staleness/mean", train),
        "token_lag_mean": mean("staleness/token_mean", train),
        "lag_max": max(r["staleness/max"] for r in train),
    }
