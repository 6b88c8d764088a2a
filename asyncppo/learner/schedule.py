"""The learning-rate schedule shared by the LLM and the embodied learners: linear warm-up, then constant or a linear
anneal to 0 at ``trainer.total_steps`` (CleanRL's ``anneal_lr``; ROLL's default ``lr_scheduler_type``).

One schedule step per learner version, not per optimizer step: the rate a version trains at does not depend on how
many mini-batches it is split into."""

from __future__ import annotations

import warnings

import torch


def lr_lambda(warmup: int, total: int, schedule: str):
    """The factor on ``trainer.lr`` after ``step`` learner versions, for ``torch.optim.lr_scheduler.LambdaLR``."""

    def factor(step: int) -> float:
        warm = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        anneal = max(0.0, 1.0 - step / max(total, 1)) if schedule == "linear" else 1.0
        return warm * anneal

    return factor


def scheduled_adamw(params, lr: float, trainer, eps: float = 1e-8
                    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` at rate ``lr`` with ``trainer``'s betas and weight decay, and its schedule (above).
    ``eps``: torch's default; the embodied learner uses CleanRL's 1e-5."""
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(trainer.betas), eps=eps, weight_decay=trainer.weight_decay)
    schedule = lr_lambda(trainer.warmup_steps, trainer.total_steps, trainer.lr_schedule)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def advance(schedule: torch.optim.lr_scheduler.LRScheduler) -> None:
    """One schedule step: the version is done, whether or not its optimizer stepped.

    A version whose gradient was zero or not finite skips ``optimizer.step()`` (learner/optim_step.py) and its
    schedule still moves on, so that the rate keeps following the version count. PyTorch warns when a schedule steps
    before its optimizer ever did ("... skipping the first value of the learning rate schedule"): a check for calls
    in the wrong order, a false alarm here, where a run whose first batch all scored the same would print it."""
    if schedule._step_count != 1 or getattr(schedule.optimizer, "_opt_called", False):
        schedule.step()  # PyTorch checks the order at the first step only; no filter (it would reset the
        return           # interpreter's warn-once records at every version)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before", category=UserWarning)
        schedule.step()
