#!/usr/bin/env python
"""Synchronous PPO against asynchronous PPO with whole-batch and with continuous generation, side by side.

Three runs of ``asyncppo launch`` on the same task, model, seed and number of trained samples:

* ``sync``        - ``max_staleness=0``, whole-batch generation (generate a batch, train on it, repeat);
* ``async-batch`` - ``max_staleness=k``, whole-batch generation, weights loaded between batches
  (``generation=batch inflight_update=off``: what asyncppo 0.1 did);
* ``async-cont``  - ``max_staleness=k``, continuous generation with in-flight weight updates
  (``generation=continuous inflight_update=keep``).

The rollout worker and the learner are pinned to disjoint cores (``--rollout-cpus`` / ``--learner-cpus``), as
disjoint GPU pools would be. For each mode it prints wall time, trained samples per second, engine occupancy,
rollout / train busy fractions, push latency p50/p99, waste, response length mean/p99 and the reward reached, and
the speed-up of each async mode over sync in learner time to the same number of trained samples, and the
pipeline's limit beside it: the engine alone and the learner alone on the same samples, each on its own cores
(scripts/pipeline_limit.py), with ``efficiency = limit / learner time`` for every mode. ``--replay`` adds the limit
on each launch's own work: the engine alone generating the launch's trained samples again at their own lengths and
the learner alone on its own batches. The limit's sides work on the starting policy's answers, a launch on those of
the policy it learns, and on ``data=long`` their lengths differ (docs/benchmarks.md).

    python scripts/bench_async_vs_sync.py --steps 60 --staleness 4            # the long-tailed reverse task
    python scripts/bench_async_vs_sync.py --modes sync,async-cont data=addition
    python scripts/bench_async_vs_sync.py --no-limit ...                     # the three launches only
    python scripts/bench_async_vs_sync.py --modes sync,async-cont+rollout.sync_every=2   # a mode's own overrides
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_limit import REPO, measure_limit, pinned_env, replay_limit  # noqa: E402  (scripts/: each side alone)

from asyncppo.config.schedules import SCHEDULES as MODES, schedule_overrides  # noqa: E402
from asyncppo.metrics.rollout import WAIT_KEYS  # noqa: E402


def run_once(label: str, args, root: str, mode: str = "") -> dict:
    """One launch in ``MODES[mode or label]``, its run directory ``root/label``. A mode may carry overrides of its
    own after ``+`` (``async-cont-lookahead+rollout.sync_every=2``): that launch only gets them."""
    base, *extra = (mode or label).split("+")
    schedule = schedule_overrides(base, args.staleness, args.lookahead)
    out = os.path.join(root, re.sub(r"[^A-Za-z0-9_.-]+", "_", label))  # a Hydra value: no '=', '+' or '/'
    cmd = [
        sys.executable, "-m", "asyncppo", "launch", *args.preset,
        f"trainer.output_dir={out}",
        f"trainer.total_steps={args.steps}",
        "trainer.logger.wandb=false",
        "trainer.eval_every=0",
        # no point-0 evaluation unless asked: its round holds the engine at version 0 while the learner waits for
        # its first push, a one-time stall the limit does not include (docs/benchmarks.md); the final one is untimed
        f"trainer.eval_at_start={'true' if args.eval_at_start else 'false'}",
        *schedule,
        *(["trainer.save_trained_groups=true"] if getattr(args, "replay", False) else []),
        *args.overrides,
        *extra,  # the mode's own overrides, after the shared ones (they win)
    ]
    env = pinned_env(args.rollout_cpus, args.learner_cpus)
    print(f"[bench] {label}: {' '.join(cmd[3:])}", flush=True)
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    load = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"  # the box's 1-minute load: others' work slows a run
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-4000:])
        raise SystemExit(f"[bench] {label} failed with exit code {proc.returncode}")
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(out, "summary.json")))
    train = [r for r in records if "reward/mean" in r]
    steady = train[len(train) // 4 :]  # skip start-up (engine load, first batches)

    def mean(key, rows):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) / max(len(vals), 1)

    train_s = sum(r["time/step_s"] for r in train)
    ro = summary.get("rollout", {})
    return {
        "label": label,
        "run_dir": out,
        "mode_overrides": [*schedule, *extra],  # what the learner alone needs to build this launch's learner
        "wall_s": wall,
        "load": load,
        "train_s": train_s,
        "update_s": sum(r.get("time/update_s", 0.0) for r in train),  # the PPO update itself
        "wait_s": sum(r.get("time/wait_s", 0.0) for r in train),  # waiting for the batch's groups
        "samples": train[-1]["samples_trained"],
        "samples_per_s": train[-1]["samples_trained"] / train_s,
        "occupancy": ro.get("occupancy", float("nan")),
        "occupancy_steady": ro.get("occupancy_steady") if ro.get("occupancy_steady") is not None else float("nan"),
        "running_mean": ro.get("running_mean", float("nan")),
        "decode_tokens_per_s": ro.get("decode_tokens_per_s", float("nan")),
        "rollout_busy": mean("util/rollout_busy", steady),
        "train_busy": mean("util/train_busy", steady),
        **{key: ro.get(key, float("nan")) for key in WAIT_KEYS},  # engine empty / slots free, by cause
        "push_p50": ro.get("push_s_p50", float("nan")),
        "push_p99": ro.get("push_s_p99", float("nan")),
        "inflight_updates": ro.get("inflight_updates", 0),
        "waste": train[-1].get("waste/tokens_frac", 0.0),
        "len_mean": ro.get("response_length_mean", float("nan")),
        "len_p99": ro.get("response_length_p99", float("nan")),
        "reward_first": mean("reward/mean", train[:10]),
        "reward_last": mean("reward/mean", train[-10:]),
        "eval_before": summary.get("eval_before", {}).get("accuracy_sampled", float("nan")),
        "eval_after": summary.get("eval_after", {}).get("accuracy_sampled", float("nan")),
        "lag_mean": mean("staleness/mean", train),
        "token_lag_mean": mean("staleness/token_mean", train),
        "lag_max": max(r["staleness/max"] for r in train),
    }


ROWS = [
    ("learner time to the same samples (s)", "train_s", "{:.1f}"),
    ("  of which the update (s)", "update_s", "{:.1f}"),
    ("  of which waiting for groups (s)", "wait_s", "{:.1f}"),
    ("wall time, whole launch (s)", "wall_s", "{:.1f}"),
    ("trained samples", "samples", "{:d}"),
    (f"load average at start / end ({os.cpu_count()} cores)", "load", "{}"),
    ("trained samples / s", "samples_per_s", "{:.1f}"),
    ("engine occupancy", "occupancy", "{:.2f}"),
    ("  without the last step (the run's drain)", "occupancy_steady", "{:.2f}"),
    ("engine: sequences a step", "running_mean", "{:.1f}"),
    ("engine: tokens a second while stepping", "decode_tokens_per_s", "{:.0f}"),
    ("rollout busy", "rollout_busy", "{:.2f}"),
    ("train busy", "train_busy", "{:.2f}"),
    ("engine empty, no ticket (s)", "idle_ticket_s", "{:.1f}"),
    ("engine empty, waiting for weights (s)", "idle_weights_s", "{:.1f}"),
    ("free slots, no ticket (engine s)", "unfilled_ticket_s", "{:.1f}"),
    ("free slots, waiting for weights (engine s)", "unfilled_weights_s", "{:.1f}"),
    ("push latency p50 (s)", "push_p50", "{:.3f}"),
    ("push latency p99 (s)", "push_p99", "{:.3f}"),
    ("in-flight weight updates", "inflight_updates", "{:d}"),
    ("waste (tokens dropped / generated)", "waste", "{:.3f}"),
    ("response length mean", "len_mean", "{:.1f}"),
    ("response length p99", "len_p99", "{:.0f}"),
    ("lag mean / token-weighted / max", None, None),
    ("reward, first 10 steps", "reward_first", "{:.3f}"),
    ("reward, last 10 steps", "reward_last", "{:.3f}"),
    ("held-out accuracy before (T=1)", "eval_before", "{:.3f}"),
    ("held-out accuracy after (T=1)", "eval_after", "{:.3f}"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--modes", default="sync,async-batch,async-cont")
    p.add_argument("--lookahead", type=int, default=1, help="rollout.admission_lookahead of the async-cont-lookahead mode")
    p.add_argument("--rollout-cpus", default="1", help="CPU ids for the rollout worker (taskset-style list: 1 or 0-7,9)")
    p.add_argument("--learner-cpus", default="0", help="CPU ids for the learner")
    p.add_argument("--preset", nargs="*", default=["data=reverse"], help="Hydra presets for every run")
    p.add_argument("--no-limit", dest="limit", action="store_false",
                   help="skip the engine-alone and learner-alone runs (the limit and efficiency rows)")
    p.add_argument("--replay", action="store_true",
                   help="after the launches, the limit on each launch's own work (its trained groups, kept with "
                        "trainer.save_trained_groups=true): the engine alone at the samples' own lengths and the "
                        "learner alone on its own batches, and the efficiency against that")
    p.add_argument("--eval-at-start", action="store_true",
                   help="evaluate the starting weights in every launch too (the 'before' row; stalls the first push)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m.split("+")[0] not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; allowed: {list(MODES)}")
    root = tempfile.mkdtemp(prefix="asyncppo-bench-")
    limits = []
    if args.limit:  # before and after the launches: on a shared box the load drifts, and the spread shows it
        limits.append(measure_limit([*args.preset, *args.overrides], args.steps, args.rollout_cpus,
                                    args.learner_cpus, os.path.join(root, "limit-before"))[0])
    results = [run_once(m, args, root) for m in modes]
    if args.limit:
        limits.append(measure_limit([*args.preset, *args.overrides], args.steps, args.rollout_cpus,
                                    args.learner_cpus, os.path.join(root, "limit-after"))[0])
    limit = mean_limit(limits) if limits else None
    if args.replay:
        for r in results:
            own, sides = replay_limit(r["run_dir"], [*args.preset, *args.overrides, *r["mode_overrides"]],
                                      args.rollout_cpus, args.learner_cpus,
                                      os.path.join(root, "replay-" + os.path.basename(r["run_dir"])))
            r["own_limit"] = own.as_dict()
            r["own_engine_tokens_per_s"] = sides["engine"]["gen_tokens"] / sides["engine"]["step_s"]
            r["own_efficiency"] = own.efficiency(r["train_s"])
    print()
    print("| metric | " + " | ".join(f"{r['label']}" for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for name, key, fmt in ROWS:
        if key is None:
            cells = [f"{r['lag_mean']:.2f} / {r['token_lag_mean']:.2f} / {r['lag_max']:.0f}" for r in results]
        else:
            cells = [("-" if r[key] != r[key] else fmt.format(r[key])) if isinstance(r[key], (int, float))
                     else str(r[key]) for r in results]  # NaN: not measured (e.g. no point-0 evaluation)
        print(f"| {name} | " + " | ".join(cells) + " |")
    base = next((r for r in results if r["label"] == "sync"), None)
    if limit is not None:
        print_limit(limit, results, base)
    if args.replay:
        print("| on the launch's own work: engine alone (s) / its occupancy | "
              + " | ".join(f"{r['own_limit']['engine_s']:.1f} / {r['own_limit']['engine_occupancy']:.2f}"
                           for r in results) + " |")
        print("| on the launch's own work: engine alone, tokens a second while stepping | "
              + " | ".join(f"{r['own_engine_tokens_per_s']:.0f}" for r in results) + " |")
        print("| on the launch's own work: learner alone (s) | "
              + " | ".join(f"{r['own_limit']['learner_s']:.1f}" for r in results) + " |")
        print("| efficiency on its own work = slower of the two / learner time | "
              + " | ".join(f"{r['own_efficiency']:.2f}" for r in results) + " |")
    if base is not None:
        for r in results:
            if r is not base:
                print(f"speed-up of {r['label']} over sync in learner time to {base['samples']} samples: "
                      f"{base['train_s'] / r['train_s']:.2f}x (whole launch {base['wall_s'] / r['wall_s']:.2f}x)")
    save_results(results, root)


def mean_limit(limits: list):
    """Each side's mean over the measurements (the limit is then the slower mean side)."""
    from asyncppo.report.limit import PipelineLimit

    def avg(key):
        return sum(getattr(m, key) for m in limits) / len(limits)

    for m in limits:
        print(f"[limit] engine alone {m.engine_s:.1f} s (occupancy {m.engine_occupancy:.2f}), "
              f"learner alone {m.learner_s:.1f} s", flush=True)
    return PipelineLimit(engine_s=avg("engine_s"), learner_s=avg("learner_s"), samples=limits[0].samples,
                         engine_occupancy=avg("engine_occupancy"))


def print_limit(limit, results: list, base) -> None:
    """The limit's rows: the same for every mode, then each mode's efficiency and speed-up over sync beside it."""
    def row(name: str, cells: list) -> None:
        print(f"| {name} | " + " | ".join(cells) + " |")

    row("engine alone, slots kept full (s) / its occupancy; mean of before and after",
        [f"{limit.engine_s:.1f} / {limit.engine_occupancy:.2f}"] * len(results))
    row("learner alone (s)", [f"{limit.learner_s:.1f}"] * len(results))
    row(f"limit (s): the {limit.slower_side} alone", [f"{limit.limit_s:.1f}"] * len(results))
    row("efficiency = limit / learner time", [f"{limit.efficiency(r['train_s']):.2f}" for r in results])
    if base is not None:
        row("speed-up over sync (learner time)", [f"{base['train_s'] / r['train_s']:.2f}x" for r in results])
    for r in results:
        r["limit"] = limit.as_dict()
        r["efficiency"] = limit.efficiency(r["train_s"])


def save_results(results: list, root: str) -> None:
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"[bench] run directories and results.json under {root}")


if __name__ == "__main__":
    main()
