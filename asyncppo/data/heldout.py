"""Held-out sets: the probe of a built-in task (prompts, sampling, scoring) and the shards of ``data.eval_files``.

Why here, as data with one scoring method: the same probe is measured by the learner (its own actor, before
training, every ``trainer.eval_every`` steps and at the end: ``eval/accuracy_sampled``, ``eval/accuracy_greedy``)
and by the single-process experiments of ``scripts/inproc.py``. Both now build a :class:`HeldOutProbe` and call
:meth:`HeldOutProbe.evaluate`, so "accuracy" means one thing: the fraction of answers that end (eos within
``max_new_tokens``) and equal the reference exactly. The learner is handed a probe and never needs the task
registry itself. ``data.eval_files`` are read here too (:func:`eval_file_sets`, one shard per worker) and measured
on the rollout engines (rollout/evaluation.py) with the run's reward function; their reports carry the same two
accuracies per file (stream/evals.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from asyncppo.data import warmstart
from asyncppo.data.datasets import PromptDataset
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


def eval_file_names(paths: list[str]) -> list[str]:
    """The metric name of each eval file: its base name, made unique with ``#2``, ``#3`` ... when names repeat."""
    names: list[str] = []
    for path in paths:
        base = os.path.basename(path) or path
        name, i = base, 2
        while name in names:
            name, i = f"{base}#{i}", i + 1
        names.append(name)
    return names


def eval_file_sets(cfg, tokenizer, worker_id: int, num_workers: int) -> dict[str, PromptDataset]:
    """This worker's shard of each of ``data.eval_files``, by metric name (:func:`eval_file_names`); a shard may be
    empty when workers outnumber a file's prompts. The rollout engines measure them (rollout/evaluation.py)."""
    d, ro = cfg.data, cfg.rollout
    sets = {}
    for name, path in zip(eval_file_names(list(d.eval_files)), d.eval_files):
        ds = PromptDataset.from_files([path], tokenizer, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                      prompt_length=ro.prompt_length, overlong=ro.overlong_prompt,
                                      apply_chat_template=d.apply_chat_template)
        sets[name] = ds.shard(worker_id, num_workers)
    return sets
