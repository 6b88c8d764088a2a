"""End to end: `asyncppo launch data=long` (responses up to 1,026 tokens) learns within the staleness bound.

The built-in long-generation task on the real vLLM CPU engine, ZeroMQ stream, gloo weight sync and Ray, with the
preset as a user gets it except for the run length, the bound and the skipped held-out probe: the training reward
rises, every trained token is within the bound, long responses are trained rather than dropped, and nothing is
left behind. It takes ~4-5 minutes on the shared 2-core box (load 10-17), far over the 100 s aimed at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from process_tags import TAG_VAR, assert_no_leftovers, new_tag

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TAG = new_tag("e2e-long")


def test_long_generation_task_learns_within_staleness_bound(tmp_path):
    """40 steps of 16 prompts x 8 samples at the preset's staleness bound k=1. Measured in three runs of the preset
    (docs/benchmarks.md, "data=long"): the training reward's mean over steps 1-10 was 0.131 / 0.130 / 0.102 and over
    steps 31-40 0.203 / 0.200 / 0.219.
    A 10-step window is 1,280 samples in groups of 8 (standard error ~0.015, ~0.02 of the difference), so the bound
    of 0.03 sits two standard errors below the measured rise. Held-out accuracy does not move measurably in 40
    steps (+0.018 and -0.004 sampled); it is left to the measured 80- and 160-step runs, and the held-out probe is
    skipped here (data.num_eval_prompts=0) to save its ~30 s per point."""
    k, steps = 1, 40  # k=2 was tried once: the rise was +0.005 (0.150 -> 0.155), so k=2 is not asserted to learn
    out = tmp_path / "run"
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", **{TAG_VAR: TAG})
    proc = subprocess.run(
        [sys.executable, "-m", "asyncppo", "launch", "data=long", f"trainer.output_dir={out}",
         "trainer.logger.wandb=false", f"trainer.total_steps={steps}", f"rollout.max_staleness={k}",
         "trainer.eval_every=0", "data.num_eval_prompts=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == steps
    assert max(r["staleness/max"] for r in train) <= k
    assert max(r["response_length/max"] for r in train) >= 500  # long answers are generated and trained
    summary = json.loads((out / "summary.json").read_text())
    assert summary["buffer"]["dropped_stale"] == 0
    first = sum(r["reward/mean"] for r in train[:10]) / 10
    last = sum(r["reward/mean"] for r in train[-10:]) / 10
    assert last - first > 0.03, (first, last)
    assert_no_leftovers(TAG)
