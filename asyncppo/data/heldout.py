"""The held-out probe of a built-in task: which prompts, how they are sampled, and how a model is scored on them.

Why here, as data with one scoring method: the same probe is measured by the learner (its own actor, before
training, every ``trainer.eval_every`` steps and at the end: ``eval/accuracy_sampled``, ``eval/accuracy_greedy``)
and by the single-process experiments of ``scripts/inproc.py``. Both now build a :class:`HeldOutProbe` and call
:meth:`HeldOutProbe.evaluate`, so "accuracy" means one thing: the fraction of answers that end (eos within
``max_new_tokens``) and equal the reference exactly. The learner is handed a probe and never needs the task
registry itself; ``data.eval_files`` are measured on the rollout engines instead (rollout/evaluation.py), with the
run's reward function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from asyncppo.data import warmstart
from asyncppo.data.tasks import get_task

SAMPLES_PER_PROMPT = 4  # sampled answers per prompt: the estimate's standard error is about half that of one sample


@dataclass(frozen=True)
class HeldOutProbe:
    """Held-out rows (``{"prompt": str, "answer": str}``) and the sampling they are measured with."""

    rows: list
    temperature: float  # of the sampled answers; the greedy ones use none
    seed: int  # of the sampled answers, so that two measurements of one model agree
    max_new_tokens: int  # the longest answer + eos: more only costs time, less cuts answers short
    samples: int = SAMPLES_PER_PROMPT

    def evaluate(self, model, tokenizer) -> dict:
        """``accuracy_sampled`` (``samples`` answers per row at ``temperature``) and ``accuracy_greedy``; the
        model is left in the training mode it came in."""
        was_training = model.training
        out = {
            "accuracy_sampled": warmstart.answer_accuracy(model, tokenizer, self.rows * self.samples,
                                                          temperature=self.temperature, seed=self.seed,
                                                          max_new_tokens=self.max_new_tokens),
            "accuracy_greedy": warmstart.answer_accuracy(model, tokenizer, self.rows, temperature=0.0,
                                                         max_new_tokens=self.max_new_tokens),
        }
        model.train(was_training)
        return out


def task_probe(cfg) -> Optional[HeldOutProbe]:
    """The probe of the run's built-in task (its eval split), sampled at the rollout temperature with the run's
    seed. ``None`` for a run on data files: there is no task answer to check (``data.eval_files`` cover those)."""
    if cfg.data.train_files:
        return None
    task = get_task(cfg.data.task, seed=cfg.data.seed, num_eval=cfg.data.num_eval_prompts)
    # the task's longest answer + eos (5 for addition, as always), never more than a rollout may generate
    max_new = min(getattr(task, "max_response_tokens", 5), cfg.rollout.response_length)
    return HeldOutProbe(rows=task.splits().eval, temperature=cfg.rollout.sampling.temperature,
                        seed=cfg.trainer.seed, max_new_tokens=max_new)
