"""``asyncppo bench fault-drill`` (and ``fault-drill-hosts``, its ``--hosts 2`` form across two test hosts):
scripts/fault_drill.py as a registered benchmark.

The drill (one short real launch, five faults injected one after another: a killed worker, a stopped worker, a
worker stopped mid-push, a killed learner, dropped connections) lives in scripts/fault_drill.py, whose reward
function a launch imports by module path (``scripts.fault_drill:paced_exact``), so it stays a script and runs here
as a subprocess, exactly as a user runs it. Its printed table is read back into figures; the drill's own exit code
(0: every fault recovered and every end check held) is the figure the target is set on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from asyncppo.bench.limit import REPO, pinned_env

SCRIPT = os.path.join(REPO, "scripts", "fault_drill.py")


def parse_table(text: str) -> list[dict]:
    """The drill's rows ``| fault | detected after | recovered after | steps lost | samples re-drawn |``; a cell
    that is not a number (``not detected``, ``NOT RECOVERED``) reads as None."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not line.startswith("|") or cells[0] in ("fault", "") or set(cells[0]) <= {"-"}:
            continue

        def number(cell: str):
            m = re.match(r"^-?\d+(\.\d+)?", cell)
            return float(m.group(0)) if m else None

        rows.append({"fault": cells[0], "detected_s": number(cells[1]), "recovered_s": number(cells[2]),
                     "steps_lost": number(cells[3]), "samples_redrawn": number(cells[4])})
    return rows


def run(opts: dict, seed: int, work: str) -> dict:
    cmd = [sys.executable, SCRIPT, "--out", work, "--steps", str(opts["steps"]), "--staleness",
           str(opts["staleness"]), "--recover-s", str(opts["recover_s"]), "--hosts", str(opts["hosts"]),
           *opts["overrides"], f"trainer.seed={seed}"]
    print(f"[fault-drill] {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=pinned_env("", ""))
    print(proc.stdout[-4000:], flush=True)
    rows = parse_table(proc.stdout)
    figures = {"drill passed": 1.0 if proc.returncode == 0 else 0.0, "faults injected": float(len(rows))}
    units = {"drill passed": "1 = yes", "faults injected": "count"}
    recovered = [r["recovered_s"] for r in rows]
    if rows:
        figures["faults not recovered"] = float(sum(v is None for v in recovered))
        figures["worst recovered after s"] = max((v for v in recovered if v is not None), default=None)
        figures["worst detected after s"] = max((r["detected_s"] for r in rows if r["detected_s"] is not None),
                                                default=None)
        figures["steps lost"] = sum(r["steps_lost"] or 0.0 for r in rows)
        units.update({"faults not recovered": "count", "worst recovered after s": "s", "worst detected after s": "s",
                      "steps lost": "steps"})
    checks = next((line for line in proc.stdout.splitlines() if line.startswith("checks:")), "")
    return {"figures": figures, "units": units,
            "detail": {"rows": rows, "checks": checks, "exit_code": proc.returncode,
                       "stderr_tail": proc.stderr[-2000:] if proc.returncode else ""}}
