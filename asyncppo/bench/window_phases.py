"""Where a window sweep's learner time went, by span of steps (issue #50: is auto's gap its start or its steady
state?).

A window sweep (``asyncppo bench auto-window*``) leaves one run directory per window and seed. For each, this sums
the learner's time (``time/step_s`` plus ``time/tune_s``, what the benchmark counts) and its wait for groups
(``time/wait_s``) over spans of steps cut at ``--cuts``, and lists the auto run's moves (step, ``k``, ``j``). On the
guess game it showed the gap to the best fixed window sitting in steps 1-5, where auto waited for one group's
latency after its opening move, with the later spans within the launches' spread.

    python -m asyncppo.bench.window_phases bench-results/auto-window-guess/work-*/ --cuts 5,29
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from asyncppo.bench.launches import learner_s


def spans(records: list[dict], cuts: list[int]) -> list[dict]:
    """The learner's time and wait summed over steps ``(0, c1], (c1, c2], ..., (cn, end]`` of ``records`` (the run's
    step records; records without ``time/step_s`` are left out)."""
    steps = [r for r in records if isinstance(r.get("time/step_s"), (int, float))]
    edges = [0, *sorted(cuts), float("inf")]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [r for r in steps if lo < r["step"] <= hi]
        out.append({"from": lo + 1, "to": int(min(hi, max((r["step"] for r in inside), default=lo))),
                    "learner_s": learner_s(inside),
                    "wait_s": sum(r.get("time/wait_s", 0.0) for r in inside)})
    return out


def moves(records: list[dict]) -> list[tuple[int, int, int]]:
    """The steps at which an auto run's window moved, with the window after: ``(step, k, j)``."""
    return [(r["step"], r["tune/k"], r["tune/j"]) for r in records if r.get("tune/reason")]


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work_dirs", nargs="+", help="window sweep work directories (holding seed-N/<label>/ run dirs)")
    ap.add_argument("--cuts", default="5,29", help="comma-separated last steps of each span but the last")
    args = ap.parse_args(argv)
    cuts = [int(c) for c in args.cuts.split(",") if c.strip()]
    for work in args.work_dirs:
        for seed_dir in sorted(glob.glob(os.path.join(work, "seed-*"))):
            for run_dir in sorted(glob.glob(os.path.join(seed_dir, "*"))):
                if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
                    continue
                recs = _records(run_dir)
                parts = spans(recs, cuts)  # they partition the steps: their sum is the run's learner time
                cells = "  ".join(f"steps {s['from']}-{s['to']}: {s['learner_s']:.1f} s (wait {s['wait_s']:.1f})"
                                  for s in parts)
                total = sum(s["learner_s"] for s in parts)
                moved = moves(recs)
                print(f"{os.path.basename(seed_dir)} {os.path.basename(run_dir):>5}  {cells}  total {total:.1f} s"
                      + (f"  moves {moved}" if moved else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
