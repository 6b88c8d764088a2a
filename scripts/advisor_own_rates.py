#!/usr/bin/env python
"""The advisor's model against finished runs: each run predicted from its own measured rates, side by side with what
it measured (engine occupancy without the run's drain, lag, learner step period), and, with ``--at K,J``, the same
run's rates predicted at other staleness settings (what a launch at that setting should show).

    .venv/bin/python scripts/advisor_own_rates.py RUN_DIR [RUN_DIR ...] [--at 12,3 --at 8,2] [--seeds 3]

A run directory is a launch's ``trainer.output_dir`` or a directory holding several (a benchmark's seed directory:
``bench-results/async-vs-sync/work-*/seed-S/``). The model is a steady state (no last slot), so the measured occupancy set
beside it is ``summary.json``'s ``rollout.occupancy_steady``; the whole run's figure is printed too. Results:
docs/benchmarks.md, "The lookahead in the advisor".
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncppo.report.rates import measure  # noqa: E402
from asyncppo.report.runs import load_run  # noqa: E402
from asyncppo.report.simulator import simulate  # noqa: E402


def run_dirs(path: str) -> list[str]:
    """``path`` itself if it holds a run, else the runs one level below it (a bench directory)."""
    if os.path.isfile(os.path.join(path, "summary.json")):
        return [path]
    found = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(path, "*", "summary.json")))
    return [d for d in found if not os.path.basename(d).startswith("replay")]


def predicted(rates, steps: int, seeds: int, **changes) -> tuple[float, float, float]:
    """Occupancy, lag mean and step period, each the mean over ``seeds`` simulator seeds."""
    results = [simulate(rates.setup(engines=1, train_ranks=1, steps=steps, warmup_steps=max(2, steps // 12), seed=s,
                                    **changes), rates.gen, rates.train, rates.lengths) for s in range(seeds)]
    return tuple(statistics.fmean(getattr(r, key) for r in results) for key in ("occupancy", "lag_mean", "step_s"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories, or bench directories holding one")
    p.add_argument("--at", action="append", default=[], metavar="K,J",
                   help="also predict each run at max_staleness K and admission_lookahead J (repeatable)")
    p.add_argument("--seeds", type=int, default=3, help="simulator seeds per prediction")
    args = p.parse_args()
    settings = [tuple(int(x) for x in at.split(",")) for at in args.at]
    print("| run | k, j | occupancy whole / **without the drain** | predicted | lag measured / predicted | "
          "step s measured / predicted |" + "".join(f" predicted at k={k}, j={j}: occupancy / lag / step s |"
                                                     for k, j in settings))
    print("|---|---|---|---|---|---|" + "---|" * len(settings))
    for path in args.runs:
        for run in run_dirs(path):
            measured = load_run(run)
            ro = measured.summary.get("rollout", {})
            train = [r for r in measured.records if "staleness/mean" in r]
            rates = measure(run)
            steps = len(train)
            occ, lag, step = predicted(rates, steps, args.seeds)
            lag_run = statistics.fmean(r["staleness/mean"] for r in train)
            step_run = sum(r["time/step_s"] for r in train) / steps
            row = (f"| {run} | {rates.max_staleness}, {rates.lookahead} | {ro.get('occupancy', float('nan')):.2f} / "
                   f"**{ro.get('occupancy_steady', float('nan')):.2f}** | {occ:.2f} | {lag_run:.2f} / {lag:.2f} | "
                   f"{step_run:.2f} / {step:.2f} |")
            for k, j in settings:
                o, l, s = predicted(rates, steps, args.seeds, max_staleness=k, lookahead=j)
                row += f" {o:.2f} / {l:.2f} / {s:.2f} |"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
