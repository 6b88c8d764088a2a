"""``asyncppo bench first-command``: the README's first command (``asyncppo launch``, no arguments) timed, and what
it learned.

A new user's first contact with asyncppo is that command on their own machine, so its wall time (the model build
included) and its held-out gain are a benchmark like the others. The install is not timed here (it depends on the
network and pip's cache): the README states it separately.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from asyncppo.bench.limit import REPO, pinned_env


def run(opts: dict, seed: int, work: str) -> dict:
    out = os.path.join(work, "run")
    cmd = [sys.executable, "-m", "asyncppo", "launch", f"trainer.output_dir={out}", *opts["overrides"],
           f"trainer.seed={seed}"]
    print(f"[first-command] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=pinned_env("", ""))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"asyncppo launch failed ({proc.returncode}): {proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    figures, units = {"launch wall s": wall}, {"launch wall s": "s"}
    for when in ("before", "after"):
        for metric in ("sampled", "greedy"):
            value = summary.get(f"eval_{when}", {}).get(f"accuracy_{metric}")
            figures[f"held-out {metric} {when}"], units[f"held-out {metric} {when}"] = value, "accuracy"
    for metric in ("sampled", "greedy"):
        a, b = figures[f"held-out {metric} before"], figures[f"held-out {metric} after"]
        figures[f"held-out {metric} gain"] = None if a is None or b is None else b - a
        units[f"held-out {metric} gain"] = "accuracy"
    print(f"[first-command] {wall:.0f} s; held-out sampled gain {figures['held-out sampled gain']}", flush=True)
    return {"figures": figures, "units": units, "detail": {"run_dir": out}}
