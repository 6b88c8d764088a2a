"""Held-out accuracy of the built-in task, measured by the learner on its own (unsharded) actor.

Why apart from :mod:`asyncppo.learner.evaluation`: that one collects the rollout engines' evaluation of
``data.eval_files``; this one measures the learner's model in the learner process, before training, every
``trainer.eval_every`` steps and at the end, and only for the built-in tasks. What is measured and how it is scored
is the probe's business (:class:`asyncppo.data.heldout.HeldOutProbe`, shared with ``scripts/inproc.py``): the
learner receives it as data and only decides when to call it.
"""

from __future__ import annotations

from typing import Callable, Optional

from asyncppo.config.schema import AsyncPPOConfig


def make_task_evaluator(cfg: AsyncPPOConfig, tokenizer, probe=None) -> Optional[Callable]:
    """``model -> {"accuracy_sampled", "accuracy_greedy"}`` for the built-in task's probe, or ``None`` for a run
    on data files. ``probe``: anything with ``evaluate(model, tokenizer) -> dict`` (a ``HeldOutProbe``), built by
    the launcher from the config; when it is not given, the task probe of ``cfg`` is built here."""
    if probe is None:
        # transitional: the launcher should build the probe (data/heldout.py: task_probe) and pass it, so that the
        # learner needs nothing from data/; until it does, the probe is built here from the config
        from asyncppo.data.heldout import task_probe

        probe = task_probe(cfg)
    if probe is None:
        return None

    def evaluate(model) -> dict:
        return probe.evaluate(model, tokenizer)

    return evaluate
