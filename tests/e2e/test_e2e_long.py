"""End to end: `asyncppo launch data=long` (responses up to 1,026 tokens) learns within the staleness bound.

The built-in long-generation task on the real vLLM CPU engine, ZeroMQ stream, gloo weight sync and Ray, with the
preset as a user gets it except for the run length and the skipped held-out probe: every trained token is within
the bound, long responses are trained rather than dropped, the policy does not collapse, and nothing is left
behind. 40 steps took ~140 s on a quiet 2-core box (load ~3), ~4-5 minutes at load 10-17; the test runs 16.
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


def test_long_generation_run_stays_within_bound_and_does_not_collapse(tmp_path):
    """16 steps of 16 prompts x 8 samples at the preset's staleness bound k=1 (the suite's budget; the failed settings
    below collapsed within 5-13 steps, so a collapse shows by step 16). Learning is NOT asserted here: in 40
    steps the training reward's rise (mean of steps 31-40 minus steps 1-10) was +0.072, +0.070, +0.117, +0.017 in
    four k=1 runs and +0.005 at k=2, too noisy for a bound that a non-learning run would fail; the held-out gain
    needs ~160 steps (+0.075 sampled, docs/benchmarks.md, "data=long"), ~18 minutes here. What is asserted: the
    bound, long answers trained rather than dropped, and no collapse (the failed settings dropped the training
    reward to 0.00-0.05 within 5-13 steps). The held-out probe is skipped (data.num_eval_prompts=0)."""
    k, steps = 1, 16
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
    first = sum(r["reward/mean"] for r in train[:5]) / 5
    last = sum(r["reward/mean"] for r in train[-5:]) / 5
    assert last - first > -0.05 and last > 0.08, (first, last)
    assert_no_leftovers(TAG)
