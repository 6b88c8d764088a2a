"""Which drift measure tracks held-out accuracy: ``actor/mismatch_kl`` or the token-weighted lag?

``algorithm.offpolicy_budget`` caps a measured drift so that an auto window (docs/staleness.md) never buys
throughput with accuracy. Two measures are at hand in every step record: ``actor/mismatch_kl`` (the behaviour ->
learner KL on the trained tokens, what the budget reads) and ``staleness/token_mean`` (the token-weighted lag in
versions). This reads the launches of window sweeps (``asyncppo bench auto-window``'s work directories: one run
directory per window and seed) and asks, within each seed (the same data and starting model, only the window
differing), how each measure ranks the launches against their held-out accuracy after training: the Spearman
correlation per seed, then its mean over seeds. A measure that tracks accuracy has a clearly negative correlation
(more drift, less accuracy); one near zero says the windows swept did not move accuracy beyond noise.

    python -m asyncppo.bench.drift_check bench-results/auto-window/work-*/ bench-results/auto-window-reverse/work-*/
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from typing import Optional

MEASURES = ("actor/mismatch_kl", "staleness/token_mean")


def launch_row(run_dir: str) -> Optional[dict]:
    """One launch: its held-out accuracy after (sampled) and each measure's mean over its training steps."""
    metrics, summary = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "summary.json")
    if not (os.path.isfile(metrics) and os.path.isfile(summary)):
        return None
    with open(metrics, encoding="utf-8") as f:
        train = [r for r in map(json.loads, f) if "reward/mean" in r]
    with open(summary, encoding="utf-8") as f:
        held = json.load(f).get("eval_after", {}).get("accuracy_sampled")
    if not train or held is None:
        return None
    row = {"run": run_dir, "held_out": float(held)}
    for m in MEASURES:
        values = [r[m] for r in train if isinstance(r.get(m), (int, float))]
        row[m] = statistics.fmean(values) if values else None
    return row


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> Optional[float]:
    """Spearman's rank correlation (None below 3 points or with a constant side)."""
    if len(x) < 3:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    if sx == 0 or sy == 0:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(rx, ry)) / (sx * sy)


def seed_groups(work_dirs: list[str]) -> dict[str, list[dict]]:
    """``{work/seed-N: [launch rows]}`` over the sweeps' work directories."""
    groups: dict[str, list[dict]] = {}
    for work in work_dirs:
        for seed_dir in sorted(glob.glob(os.path.join(work, "seed-*"))):
            rows = [r for r in (launch_row(d) for d in sorted(glob.glob(os.path.join(seed_dir, "*")))) if r]
            if rows:
                groups[seed_dir] = rows
    return groups


def correlations(groups: dict[str, list[dict]]) -> dict[str, dict]:
    """Per measure: the Spearman correlation with held-out accuracy in each seed group, and their mean."""
    out = {}
    for m in MEASURES:
        per = {}
        for key, rows in groups.items():
            pts = [(r[m], r["held_out"]) for r in rows if r[m] is not None]
            rho = spearman([p[0] for p in pts], [p[1] for p in pts])
            if rho is not None:
                per[key] = rho
        out[m] = {"per_seed": per, "mean": statistics.fmean(per.values()) if per else None}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work_dirs", nargs="+", help="window sweeps' work directories (work-<time>/ with seed-N/ inside)")
    args = p.parse_args(argv)
    groups = seed_groups(args.work_dirs)
    for key, rows in groups.items():
        print(key)
        for r in rows:
            print(f"  {os.path.basename(r['run']):>6}  held-out {r['held_out']:.3f}  "
                  + "  ".join(f"{m} {r[m]:.4f}" if r[m] is not None else f"{m} -" for m in MEASURES))
    for m, c in correlations(groups).items():
        per = ", ".join(f"{v:+.2f}" for v in c["per_seed"].values())
        mean = "-" if c["mean"] is None else f"{c['mean']:+.2f}"
        print(f"{m}: Spearman with held-out accuracy per seed [{per}], mean {mean}")


if __name__ == "__main__":
    main()
