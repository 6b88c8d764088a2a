"""End to end: ``rollout.max_staleness=auto`` on the default task (its preset's engine, CPU): the run completes,
every step's record carries the window in force (``tune/k``, ``tune/j``), each change is said on the console with
its reason, the summary table gives the range, and no sample was trained past the cap or past the largest k in
force so far (the bound stays exact while the window moves: docs/staleness.md, "A window that moves").

The same launch pushes at ``rollout.sync_every=auto`` (learner/push_cadence.py): every step's ``sync/every`` is the
rule on the loads and step times of the records before it, within the smallest lookahead held so far, and the
weights sent are never more than that many steps behind. On this task loads are a few milliseconds against steps of
about a second, so the cadence is expected to stay 1 (test_learner_loop.py drives the rule to longer cadences).

Why a config file that says ``auto`` (which starts at k = 4, config/validate_window.py) rather than the override
(which starts at the default config's k = 1): this task is learner-bound on 2 cores, so from 4 the tuner lowers the
window, the harder direction for the bound (tickets granted under the old k are still trained after the change).
Measured: k 4 -> 3 -> 2 -> 1 at steps 10, 20, 30, lag max 4 then 3, 2, 1 as each older window drained; ~50 s.
The decisions are made in the tuner's own process (pipeline/tuner_host.py), so a move lands a step or two after its
decision was due."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from asyncppo.learner.push_cadence import WINDOW, cadence
from test_e2e_launch import ASYNCPPO, REPO, TAG, TAG_VAR

pytestmark = pytest.mark.slow

CAP = 6


def test_auto_window_moves_logs_its_window_and_keeps_the_bound(tmp_path: Path):
    conf, out_dir = tmp_path / "auto.yaml", tmp_path / "run"
    conf.write_text("rollout:\n  max_staleness: auto\n")
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", **{TAG_VAR: TAG})
    proc = subprocess.run(
        [*ASYNCPPO, "launch", "--config-file", str(conf), "data=addition", f"trainer.output_dir={out_dir}",
         "trainer.logger.wandb=false", "rollout.tune_every=5", f"rollout.max_staleness_cap={CAP}",
         "trainer.total_steps=40", "rollout.rollout_batch_size=8", "rollout.sync_every=auto"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == 40 and train[0]["tune/k"] == 4
    largest = 0
    for r in train:
        assert isinstance(r.get("tune/k"), int) and isinstance(r.get("tune/j"), int), r
        assert 0 <= r["tune/j"] <= r["tune/k"] <= CAP
        # tune/k is the window after this step's decision; this step's samples were granted under earlier ones
        largest = max(largest, r["tune/k"])
        assert r["staleness/max"] <= CAP and r["staleness/max"] <= largest, r
    changes = [r for r in train if r.get("tune/reason")]
    assert changes, "the window never moved"
    # decided in the tuner's own process (pipeline/tuner_host.py): the learner's thread is held for milliseconds a
    # step (time/tune_s, which a benchmark adds to the steps' time), not for a decision
    decided = [r["tune/decide_s"] for r in train if "tune/decide_s" in r]
    assert decided and all(0 <= r["time/tune_s"] < 0.5 for r in train), [r.get("time/tune_s") for r in train]
    out = proc.stdout + proc.stderr
    assert out.count("[asyncppo] window k ") == len(changes)  # each change said once on the console, with why
    assert "window k / j (auto" in out  # the summary table's row: the range the window took
    _assert_push_cadence(train, json.loads((out_dir / "summary.json").read_text()))


def _assert_push_cadence(train: list[dict], summary: dict) -> None:
    """Each step's cadence is the rule on the records before it (medians of the last WINDOW loads and steps), within
    the smallest lookahead in force so far; the weights sent lag the version by less than the cadence."""
    from statistics import median

    j_min = 4  # the auto window's start (k = j = 4)
    for i, r in enumerate(train):
        loads = [p["sync/load_s"] for p in train[:i] if p["sync/load_s"] > 0][-WINDOW:]
        steps = [p["time/step_s"] for p in train[:i]][-WINDOW:]
        expected = cadence(median(loads) if loads else 0.0, median(steps) if steps else 0.0, j_min)
        assert r["sync/every"] == expected, (i, r["sync/every"], expected, loads, steps, j_min)
        if i < len(train) - 1:  # the last step pushes only for an evaluation on the engines
            assert r["step"] - r["sync/weights_version"] < r["sync/every"], r
        j_min = min(j_min, r["tune/j"])
    assert summary["sync_every_range"] == [min(r["sync/every"] for r in train), max(r["sync/every"] for r in train)]
