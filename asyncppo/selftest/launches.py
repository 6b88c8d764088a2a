"""What the self-test's launch rungs share: whether the launcher's libraries import here, one real
``asyncppo launch`` in a subprocess with its training records read back, and a mean over those records.

Why a module of its own: the ``--gpus 1`` rung, the two-GPU rung and the ``data=long`` rung each start real launches
and read the same ``metrics.jsonl``; one copy of how that is done keeps their figures comparable.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

from asyncppo.selftest.ladder import Context

LAUNCH_STACK = ("ray", "zmq", "hydra", "omegaconf")


def importable(name: str) -> bool:
    """Whether ``name`` imports here (an ImportError, or None planted in sys.modules, says no)."""
    try:
        importlib.import_module(name)
        return True
    except Exception:
        return False


def missing_launch_stack() -> list[str]:
    """The launcher's libraries that cannot be imported here."""
    return [name for name in LAUNCH_STACK if not importable(name)]


def launch_run(ctx: Context, name: str, args: list[str], timeout_s: float) -> tuple[str, list[dict]]:
    """One real ``asyncppo launch``; returns its run directory and its training records. Raises on failure."""
    out = os.path.join(ctx.out_dir, name)
    cmd = [sys.executable, "-m", "asyncppo", "launch", f"trainer.output_dir={out}", "trainer.logger.wandb=false",
           *args]
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    with open(os.path.join(ctx.out_dir, f"{name}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = " / ".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        raise RuntimeError(f"launch exited {proc.returncode}: {tail}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return out, [r for r in records if "reward/mean" in r]


def mean_of(records: list[dict], key: str) -> float:
    """The mean of ``key`` over the records that have it, to 3 places (nan when none has it)."""
    values = [float(r[key]) for r in records if key in r]
    return round(sum(values) / len(values), 3) if values else float("nan")
