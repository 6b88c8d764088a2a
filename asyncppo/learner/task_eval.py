"""Held-out accuracy of the built-in task, measured by the learner on its own (unsharded) actor.

Why apart from :mod:`asyncppo.learner.evaluation`: that one collects the rollout engines' evaluation of
``data.eval_files``; this one measures the learner's model in the learner process, before training, every
``trainer.eval_every`` steps and at the end, and only for the built-in tasks. What is measured and how it is scored
is the probe's business (:class:`asyncppo.data.heldout.HeldOutProbe`, shared with ``scripts/inproc.py``): the
launcher builds it from the config and hands it over as data, so the learner only decides when to call it.
"""

from __future__ import annotations

from typing import Callable, Optional


def make_task_evaluator(probe, tokenizer) -> Optional[Callable]:
    """``model -> {"accuracy_sampled", "accuracy_greedy"}`` for the built-in task's probe, or ``None`` for a run
    on data files (no probe). ``probe``: anything with ``evaluate(model, tokenizer) -> dict`` (a ``HeldOutProbe``)."""
    if probe is None:
        return None

    def evaluate(model) -> dict:
        return probe.evaluate(model, tokenizer)

    return evaluate
