"""Held-out accuracy of the built-in task, measured by the learner on its own (unsharded) actor.

Why apart from :mod:`asyncppo.learner.evaluation`: that one asks the rollout engines to evaluate ``data.eval_files``;
this one runs ``model.generate`` in the learner process, before training, every ``trainer.eval_every`` steps and at
the end, and only for the built-in tasks (a run with ``data.train_files`` has no task answer checker here).
"""

from __future__ import annotations

from asyncppo.config.schema import AsyncPPOConfig


def make_task_evaluator(cfg: AsyncPPOConfig, tokenizer):
    """Held-out accuracy of the built-in task: sampled at the rollout temperature (4 samples per prompt, so the
    estimate's standard error is about half that of one sample) and greedy. ``None`` for a run on data files."""
    if cfg.data.train_files:
        return None
    from asyncppo.data.tasks import get_task
    from asyncppo.data.warmstart import answer_accuracy

    task = get_task(cfg.data.task, seed=cfg.data.seed, num_eval=cfg.data.num_eval_prompts)
    rows = task.splits().eval
    temperature = cfg.rollout.sampling.temperature
    # the task's longest answer + eos (5 for addition, as always), never more than a rollout may generate
    max_new = min(getattr(task, "max_response_tokens", 5), cfg.rollout.response_length)

    def evaluate(model) -> dict:
        was_training = model.training
        out = {
            "accuracy_sampled": answer_accuracy(model, tokenizer, rows * 4, temperature=temperature,
                                                seed=cfg.trainer.seed, max_new_tokens=max_new),
            "accuracy_greedy": answer_accuracy(model, tokenizer, rows, temperature=0.0, max_new_tokens=max_new),
        }
        model.train(was_training)
        return out

    return evaluate
