"""Resuming a run at its last step: finished when its final model is missing, refused when there is nothing left
to do (launch/resolve.py), on real embodied checkpoints (a policy state, no model directory needed)."""

from __future__ import annotations

import pytest
import torch

from asyncppo.config import load_config
from asyncppo.launch.resolve import LaunchError, _embodied_resume_note
from asyncppo.learner.embodied_checkpoint import save_embodied


def _note(run, total):
    return _embodied_resume_note(load_config(["env=cartpole", f"trainer.resume_from={run}",
                                              f"trainer.total_steps={total}"]))


def test_a_checkpoint_before_the_end_resumes(tmp_path):
    run = tmp_path / "run"
    path = save_embodied(str(run), 5, {"policy": {"w": torch.zeros(2)}})
    assert _note(run, 10) == f"resuming from {path} (step 5)"


def test_a_checkpoint_at_the_end_without_a_final_model_finishes_the_run(tmp_path):
    run = tmp_path / "run"
    path = save_embodied(str(run), 10, {"policy": {"w": torch.zeros(2)}})
    # the run stopped (or its launch died) after its last checkpoint, before final/: the relaunch finishes it
    assert _note(run, 10) == (f"resuming from {path} (step 10): no step left to train, finishing the run (its final "
                              "evaluation and model)")
    (run / "final").mkdir()
    with pytest.raises(LaunchError, match="is at step 10, but trainer.total_steps=10 .* nothing left to train"):
        _note(run, 10)


def test_a_checkpoint_past_the_end_is_refused(tmp_path):
    run = tmp_path / "run"
    save_embodied(str(run), 12, {"policy": {"w": torch.zeros(2)}})
    with pytest.raises(LaunchError, match="is at step 12, but trainer.total_steps=10 is the total number of steps"):
        _note(run, 10)
