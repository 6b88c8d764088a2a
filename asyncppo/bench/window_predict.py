"""How well the window tuner's model predicts the windows it chooses between (issue #50: the advisor and the
controller share one model, and its prediction error on the sweeps is reported).

A window sweep (``asyncppo bench auto-window*``) leaves one run directory per fixed window and seed. For each seed,
the tuner that ``rollout.max_staleness=auto`` runs (:class:`asyncppo.pipeline.tuner.WindowTuner`, built by the
learner's own hook from the run's config) is fed one fixed window's step records and trained groups' lengths, as
the hook feeds them (its last ``history`` steps), and predicts samples/s at every fixed window of the seed. Each
prediction is set against that window's measured rate: trained samples over the learner's time, past the same
warm-up steps the simulation leaves out. Two readings:

* **own**: each window predicted from its own run's rates (the model alone: does it reproduce the run it was fed?);
* **from the narrowest**: every window predicted from the narrowest window's run (what auto, started narrow, must
  extrapolate before it has seen a wider window).

Both say ``predicted / measured`` per window, and the ratio of the predicted speed-ups (a window over the narrowest)
to the measured ones, which is what a decision compares.

    python -m asyncppo.bench.window_predict bench-results/auto-window-guess/work-*/
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

from asyncppo.config.loader import config_from_yaml
from asyncppo.learner.window import window_hook
from asyncppo.pipeline.tuner import SIM_WARMUP
from asyncppo.staleness.controller import AdmissionController


def _read(run_dir: str) -> tuple:
    """A run's config, its training step records and its trained groups' lengths per step. ``summary.json`` keeps
    every trained group's lengths in step order up to 512 groups, then a reservoir sample of the run's groups
    (metrics/rollout.py): then the sample is handed with the last step (the tuner keeps the newest 256), a run-wide
    draw where the hook would have fed the last steps' groups."""
    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
        cfg = config_from_yaml(f.read())
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        train = [r for r in map(json.loads, f) if "time/step_s" in r]
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    groups = [[int(x) for x in g.split()] for g in summary["rollout"]["group_lengths"]]
    B = cfg.rollout.rollout_batch_size
    if len(groups) != len(train) * B:  # a reservoir sample, not the run's groups in order
        return cfg, train, [[] for _ in train[:-1]] + [groups]
    return cfg, train, [groups[i * B:(i + 1) * B] for i in range(len(train))]


def measured(run_dir: str, warmup: int) -> float:
    """Trained samples per second of learner time past the first ``warmup`` steps (the simulation's warm-up)."""
    cfg, train, _ = _read(run_dir)
    steady = train[warmup:]
    if not steady:
        raise ValueError(f"{run_dir}: {len(train)} steps, none past the {warmup} warm-up steps")
    r = cfg.rollout
    return len(steady) * r.rollout_batch_size * r.num_return_sequences_in_group / sum(x["time/step_s"] for x in steady)


def predictions(run_dir: str, windows: list[int], lookahead: int) -> dict[int, float]:
    """Samples/s the tuner predicts at each window ``k`` (``j = min(lookahead, k)``) from ``run_dir``'s rates."""
    cfg, train, groups = _read(run_dir)
    cfg.rollout.window_auto = "k,j"  # the tuner as an auto run builds it (both knobs free to predict any window)
    hook = window_hook(cfg, AdmissionController(cfg.rollout.rollout_batch_size, cfg.rollout.max_staleness_cap),
                       lambda _line: None, engines=cfg.cluster.rollout_workers, background=False)
    tuner = hook.tuner
    for record, lengths in zip(train, groups):
        tuner.record(record, lengths)
    return {k: tuner.predict(k, min(lookahead, k)).samples_per_s for k in windows}


def seed_table(seed_dir: str, lookahead: int) -> list[dict]:
    """Per fixed window of one seed's sweep: measured samples/s, and predicted from its own rates and from the
    narrowest window's."""
    runs = {int(os.path.basename(d)[1:]): d for d in glob.glob(os.path.join(seed_dir, "k*")) if
            os.path.basename(d)[1:].isdigit() and os.path.isfile(os.path.join(d, "summary.json"))}
    windows = sorted(runs)
    if not windows:
        return []
    narrow = predictions(runs[windows[0]], windows, lookahead)
    rows = []
    for k in windows:
        own = narrow[k] if k == windows[0] else predictions(runs[k], [k], lookahead)[k]  # the narrowest's: done
        rows.append({"k": k, "measured": measured(runs[k], SIM_WARMUP), "own": own, "from_narrowest": narrow[k],
                     "narrowest": windows[0]})
    base = rows[0]
    for row in rows:
        row["speedup_measured"] = row["measured"] / base["measured"]
        row["speedup_predicted"] = row["from_narrowest"] / base["from_narrowest"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work_dirs", nargs="+", help="window sweep work directories (holding seed-N/kK/ run dirs)")
    ap.add_argument("--lookahead", type=int, default=16, help="the sweep's lookahead option (j = min(it, k))")
    args = ap.parse_args(argv)
    own, narrow, speedups = [], [], []
    print("| seed | k | measured samples/s | predicted, own rates | / measured | predicted from the narrowest | "
          "/ measured | speed-up over the narrowest, predicted / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for work in args.work_dirs:
        for seed_dir in sorted(glob.glob(os.path.join(work, "seed-*"))):
            for row in seed_table(seed_dir, args.lookahead):
                o, n = row["own"] / row["measured"], row["from_narrowest"] / row["measured"]
                s = row["speedup_predicted"] / row["speedup_measured"]
                own.append(o)
                narrow.append(n)
                if row["k"] != row["narrowest"]:  # the narrowest's speed-up over itself is 1 on both sides
                    speedups.append(s)
                print(f"| {os.path.basename(seed_dir)} | {row['k']} | {row['measured']:.1f} | {row['own']:.1f} | "
                      f"{o:.2f} | {row['from_narrowest']:.1f} | {n:.2f} | {s:.2f} |", flush=True)
    mean_abs = lambda xs: f"{statistics.fmean(abs(x - 1.0) for x in xs):.1%}" if xs else "n/a"  # noqa: E731
    print(f"mean |error|: own rates {mean_abs(own)}, from the narrowest {mean_abs(narrow)}, "
          f"speed-ups {mean_abs(speedups)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
