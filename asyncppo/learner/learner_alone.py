"""The learner alone at full speed: the other side of the pipeline's limit (docs/benchmarks.md, "The limit").

The run's own models and PPO update (learner/build.py), trained on pre-generated groups with nothing else in the
process: no sockets, no feeder thread, no admission, no weight push, no waiting. The batches are taken in ticket
order, ``rollout_batch_size`` groups each, as the staleness buffer hands them out, so the update sees the same
batches (and the same lengths) the pipelined learner would.
"""

from __future__ import annotations

import time

import torch

from asyncppo.config.devices import learner_on_gpu
from asyncppo.learner.batch import collate_groups
from asyncppo.learner.build import build_models


def train_alone(cfg, model_path: str, groups: list, steps: int | None = None) -> dict:
    """Train ``steps`` updates (default: as many whole batches as ``groups`` hold) and time each one, from the
    collation of its batch to the end of the update. Returns ``learner_s`` (their sum), ``step_s`` (each),
    ``steps`` and ``samples``."""
    from transformers import AutoTokenizer  # heavy: transformers

    per_batch = cfg.rollout.rollout_batch_size
    ordered = sorted(groups, key=lambda g: g.ticket)
    steps = len(ordered) // per_batch if steps is None else int(steps)
    if steps < 1 or steps * per_batch > len(ordered):
        raise ValueError(f"learner alone: {len(ordered)} groups cannot fill {steps} batches of "
                         f"rollout.rollout_batch_size={per_batch}")
    torch.manual_seed(cfg.trainer.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and learner_on_gpu(cfg) else "cpu")
    models = build_models(cfg, model_path, None, device, 0, 1)
    pad = AutoTokenizer.from_pretrained(model_path).pad_token_id
    step_s, samples = [], 0
    for i in range(steps):
        t0 = time.perf_counter()
        batch = collate_groups(ordered[i * per_batch:(i + 1) * per_batch], pad)
        models.updater.step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        samples += batch.size
    return {"learner_s": sum(step_s), "step_s": step_s, "steps": steps, "samples": samples}
