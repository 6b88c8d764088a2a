"""learner/schedule.py: ``advance`` moves the schedule once per version, also for a version whose optimizer did not
step, and says nothing about it (PyTorch's order warning is a false alarm there)."""

from __future__ import annotations

import warnings

import pytest
import torch
from omegaconf import OmegaConf

from asyncppo.learner.schedule import advance, scheduled_adamw


def test_a_version_without_an_optimizer_step_still_moves_the_rate_and_warns_nothing():
    trainer = OmegaConf.create(dict(betas=[0.9, 0.999], weight_decay=0.0, warmup_steps=0, total_steps=4,
                                    lr_schedule="linear"))
    weight = torch.nn.Parameter(torch.ones(2))
    opt, schedule = scheduled_adamw([weight], 1e-3, trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        advance(schedule)  # version 0: a zero gradient, no optimizer step
    # linear anneal over 4 versions: 1e-3 x (1 - 1/4) after one version
    assert opt.param_groups[0]["lr"] == pytest.approx(7.5e-4)
    weight.grad = torch.ones(2)
    opt.step()
    advance(schedule)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_plain_step_order_warning_is_what_advance_hides():
    """The warning is PyTorch's, so the filter above has something to hide (a changed message would let it through
    and fail the test above instead of passing silently)."""
    trainer = OmegaConf.create(dict(betas=[0.9, 0.999], weight_decay=0.0, warmup_steps=0, total_steps=4,
                                    lr_schedule="constant"))
    _, schedule = scheduled_adamw([torch.nn.Parameter(torch.ones(2))], 1e-3, trainer)
    with pytest.warns(UserWarning, match=r"Detected call of `lr_scheduler.step\(\)` before"):
        schedule.step()
