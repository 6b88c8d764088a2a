"""The pieces of a learner restart that need no cluster: embodied checkpoints on disk, the steps that survive a
restart in a run's records, and how far a dead learner got (launch/learner_restart.py)."""

from __future__ import annotations

import json

import pytest
import torch

from asyncppo.launch.learner_restart import has_checkpoint, last_logged_step
from asyncppo.learner.checkpoint import CheckpointError, resolve_checkpoint
from asyncppo.learner.embodied_checkpoint import load_embodied, resolve_embodied, save_embodied
from asyncppo.report.runs import surviving_steps


def test_embodied_checkpoints_are_written_whole_found_by_run_dir_and_pruned(tmp_path):
    state = {"policy": {"w": torch.arange(6.0).reshape(2, 3)}, "recent": [1.0, 2.5], "env_steps": 512}
    assert not has_checkpoint(str(tmp_path))
    save_embodied(str(tmp_path), 5, state, keep=1)
    path = save_embodied(str(tmp_path), 10, dict(state, env_steps=1024), keep=1)
    assert has_checkpoint(str(tmp_path))
    assert resolve_embodied(str(tmp_path)) == (path, 10)  # the run dir: its checkpoints/latest
    assert resolve_embodied(path) == (path, 10)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_10"]  # keep=1 pruned 5
    back = load_embodied(path)
    assert torch.equal(back["policy"]["w"], state["policy"]["w"])
    assert (back["recent"], back["env_steps"], back["version"]) == ([1.0, 2.5], 1024, 10)
    # an LLM run's loader does not take it for one of its own, and an empty directory names the option
    with pytest.raises(CheckpointError):
        resolve_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="trainer.save_every"):
        resolve_embodied(str(tmp_path / "checkpoints" / "nothing-here"))


def test_the_steps_a_dead_learner_logged_past_its_checkpoint_do_not_survive():
    # steps 1-7 by the first learner (checkpoint at 4), then the restarted one from 5
    records = [{"step": s, "who": "a"} for s in range(1, 8)] + [{"step": s, "who": "b"} for s in range(5, 10)]
    kept = surviving_steps(records)
    assert [(r["step"], r["who"]) for r in kept] == [(s, "a") for s in range(1, 5)] + [(s, "b") for s in range(5, 10)]
    assert surviving_steps([{"step": 0, "eval/x": 1}, {"step": 1}]) == [{"step": 0, "eval/x": 1}, {"step": 1}]


def test_how_far_the_dead_learner_got(tmp_path):
    assert last_logged_step(str(tmp_path)) == 0
    lines = [{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "staleness/max": 1}, {"step": 2, "staleness/max": 0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + '\n{"step": 3, "stal')
    assert last_logged_step(str(tmp_path)) == 2  # evaluation records and a line cut short by the death do not count


def test_a_second_death_is_not_credited_with_the_first_ones_steps(tmp_path):
    """First learner logs 1..50 and dies (checkpoint 40); the second logs 41..45 and dies: it reached 45, not 50."""
    lines = [{"step": s, "staleness/max": 0} for s in range(1, 51)] + [{"step": s, "staleness/max": 0}
                                                                       for s in range(41, 46)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert last_logged_step(str(tmp_path)) == 45
