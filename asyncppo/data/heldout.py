"""Held-out sets: the probe of a built-in task (prompts, sampling, scoring) and the shards of ``data.eval_files``.

One evaluation path: a run's held-out sets, the built-in task's eval split (:func:`task_eval_set`) and each of
``data.eval_files`` (:func:`eval_file_sets`), are all measured on the rollout engines (rollout/evaluation.py), beside
training generation, at step 0, every ``trainer.eval_every`` steps and on the final weights; the learner only adds
the workers' reports (learner/evaluation.py). The learner, the bottleneck of the built-in recipe, no longer spends
its steps on ``generate``.

Why the task's set keeps its own definition: its numbers (``eval/accuracy_sampled``, ``eval/accuracy_greedy``) are
the run's headline and are compared across runs, so they are what :class:`HeldOutProbe` always measured: ``samples``
answers per row at the rollout temperature plus one greedy answer, at most the task's longest answer + eos tokens,
and "correct" means the answer ends (eos within that budget) and equals the reference exactly
(:func:`is_exact_answer`), whatever ``rollout.reward_fn`` says; the sampled answers are seeded from
``trainer.seed`` and the same at every point, so two points differ by the weights, not by the draw. Eval files are
scored with the run's reward function (their "accuracy" is the mean reward). ``asyncppo/bench/inproc.py`` still calls
:meth:`HeldOutProbe.evaluate` on an in-process model, with the same definition.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from asyncppo.data import warmstart
from asyncppo.data.datasets import PromptDataset
from asyncppo.data.tasks import get_task
from asyncppo.data.text_row_draws import TextRowDataset, text_env_rows_in

SAMPLES_PER_PROMPT = 4  # sampled answers per prompt: the estimate's standard error is about half that of one sample


@dataclass(frozen=True)
class HeldOutProbe:
    """Held-out rows (``{"prompt": str, "answer": str}``) and the sampling they are measured with."""

    rows: list
    temperature: float  # of the sampled answers; the greedy ones use none
    seed: int  # of the sampled answers, so that two measurements of one model agree
    max_new_tokens: int  # the longest answer + eos: more only costs time, less cuts answers short
    samples: int = SAMPLES_PER_PROMPT
    episodes: bool = False  # a multi-turn task's rows: each answer is an episode on the engines (its reward scores)

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


def is_exact_answer(text: str, answer: str, ended: bool) -> bool:
    """The probe's "correct": the answer ended (eos within the token budget) and is the reference exactly."""
    return ended and text.strip() == answer


@dataclass(frozen=True)
class EvalSet:
    """One held-out set as the engines measure it: this worker's shard and how each prompt is sampled and scored.

    ``seed``: of the sampled answers (None: the engine's own draw); ``paired``: the same seed at every evaluation
    point (the task's probe, so before/after differ by the weights only) or a fresh one per point (eval files, as
    before); ``exact``: scored by :func:`is_exact_answer` rather than the run's reward function; ``episodes``: the
    rows are SkyRL-format rows (:class:`~asyncppo.data.text_row_draws.TextRowDataset`) of a text-environment run,
    and each answer is an episode played with ``env.text_env``, scored by its environment (its turn rewards' sum)."""

    dataset: Any  # a PromptDataset, or a TextRowDataset when ``episodes``
    samples: int
    max_tokens: int
    seed: Optional[int]
    paired: bool = False
    exact: bool = False
    episodes: bool = False

    def sample_seed(self, index: int, point: int) -> Optional[int]:
        """The seed of prompt ``index``'s sampled answers at ``point`` (the engine seeds answer ``j`` with +j)."""
        if self.seed is None:
            return None
        return self.seed + 7919 * index + (0 if self.paired else 104729 * point)


def task_probe(cfg) -> Optional[HeldOutProbe]:
    """The probe of the run's built-in task (its eval split), sampled at the rollout temperature with the run's
    seed. ``None`` for a run on data files: there is no task answer to check (``data.eval_files`` cover those)."""
    if cfg.data.train_files:
        return None
    task = get_task(cfg.data.task, seed=cfg.data.seed, num_eval=cfg.data.num_eval_prompts)
    # the task's longest answer + eos (5 for addition, as always), never more than a rollout may generate
    max_new = min(getattr(task, "max_response_tokens", 5), cfg.rollout.response_length)
    return HeldOutProbe(rows=task.splits().eval, temperature=cfg.rollout.sampling.temperature,
                        seed=cfg.trainer.seed, max_new_tokens=max_new,
                        # a run that plays episodes (an environment or an agent program) evaluates its held-out rows as
                        # episodes too: the game seeded by an addition row (data=guess) is scored by its game
                        episodes=bool(cfg.env.text_env or cfg.env.agent))


def has_eval_sets(cfg) -> bool:
    """Whether the run evaluates anything on the engines: a built-in task's probe or ``data.eval_files``."""
    return bool(cfg.data.eval_files) or (not cfg.data.train_files and cfg.data.num_eval_prompts > 0)


def task_eval_set(cfg, tokenizer, worker_id: int, num_workers: int) -> Optional[EvalSet]:
    """This worker's shard of the built-in task's probe (:func:`task_probe`: the same rows, samples, temperature,
    seed and token budget), or None for a run on data files or with ``data.num_eval_prompts=0``."""
    probe = task_probe(cfg)
    if probe is None or not probe.rows:
        return None
    ro = cfg.rollout
    dataset = PromptDataset(probe.rows, tokenizer, prompt_length=ro.prompt_length, overlong=ro.overlong_prompt,
                            apply_chat_template=cfg.data.apply_chat_template)
    if probe.episodes:  # a multi-turn task: each answer is an episode, scored by its environment (or agent)
        return EvalSet(dataset.shard(worker_id, num_workers), samples=probe.samples, max_tokens=ro.response_length,
                       seed=probe.seed, paired=True, episodes=True)
    return EvalSet(dataset.shard(worker_id, num_workers), samples=probe.samples, max_tokens=probe.max_new_tokens,
                   seed=probe.seed, paired=True, exact=True)


def eval_file_names(paths: list[str], reserved: tuple[str, ...] = ()) -> list[str]:
    """The metric name of each eval file: its base name, made unique with ``#2``, ``#3`` ... when names repeat
    or are ``reserved`` (the task probe's name)."""
    names: list[str] = []
    for path in paths:
        base = os.path.basename(path) or path
        name, i = base, 2
        while name in names or name in reserved:
            name, i = f"{base}#{i}", i + 1
        names.append(name)
    return names


def eval_file_sets(cfg, tokenizer, worker_id: int, num_workers: int,
                   reserved: tuple[str, ...] = ()) -> dict:
    """This worker's shard of each of ``data.eval_files``, by metric name (:func:`eval_file_names`); a shard may be
    empty when workers outnumber a file's prompts. The rollout engines measure them (rollout/evaluation.py).
    SkyRL-format rows of a text-environment run (``env.text_env``) become :class:`EvalSet` s of episodes; such rows
    in a run without an environment are refused by name (there is nothing to play them with)."""
    d, ro = cfg.data, cfg.rollout
    files, names = list(d.eval_files), eval_file_names(list(d.eval_files), reserved)
    if files and text_env_rows_in(files, d.prompt_key, "data.eval_files"):
        if not cfg.env.text_env:
            raise ValueError(f"data.eval_files={files}: SkyRL-format rows (a prompt of chat messages) are episodes "
                             "of a text environment; set env.text_env, or give {prompt, answer} rows")
        return {name: EvalSet(TextRowDataset.from_files([path], d.prompt_key).shard(worker_id, num_workers),
                              samples=d.eval_samples, max_tokens=ro.response_length, seed=ro.sampling.seed,
                              episodes=True) for name, path in zip(names, files)}
    sets = {}
    for name, path in zip(names, files):
        ds = PromptDataset.from_files([path], tokenizer, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                      prompt_length=ro.prompt_length, overlong=ro.overlong_prompt,
                                      apply_chat_template=d.apply_chat_template)
        sets[name] = ds.shard(worker_id, num_workers)
    return sets
