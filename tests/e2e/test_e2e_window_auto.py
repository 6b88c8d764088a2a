"""End to end: ``rollout.max_staleness=auto`` on the default task (the preset's engine, CPU): the run completes,
every step's record carries the window in force (``tune/k``, ``tune/j``), the summary table gives its range, and no
sample was trained past the cap or past the largest k in force so far (the bound stays exact while it moves:
docs/staleness.md, "A window that moves"). About 90 s on 2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_e2e_launch import _launch

pytestmark = pytest.mark.slow

CAP = 6


def test_auto_window_runs_logs_its_window_and_keeps_the_bound(tmp_path: Path):
    proc, records = _launch(tmp_path, "rollout.max_staleness=auto", "rollout.tune_every=5",
                            f"rollout.max_staleness_cap={CAP}", "trainer.total_steps=30",
                            "rollout.rollout_batch_size=8", timeout=400, engine=None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == 30
    largest = 0
    for r in train:
        assert isinstance(r.get("tune/k"), int) and isinstance(r.get("tune/j"), int), r
        assert 0 <= r["tune/j"] <= r["tune/k"] <= CAP
        # tune/k is the window after this step's decision; the samples of this step were granted before it
        assert r["staleness/max"] <= CAP and r["staleness/max"] <= max(largest, r["tune/k"]), r
        largest = max(largest, r["tune/k"])
    changes = [r for r in train if r.get("tune/reason")]
    out = proc.stdout + proc.stderr
    assert out.count("[asyncppo] window k ") == len(changes)  # each change said once on the console, with why
    assert "window k / j (auto" in out  # the summary table's row: the range the window took
