"""The learner alone at full speed: the other side of the pipeline's limit (docs/benchmarks.md, "The limit").

The run's own models and PPO update (learner/build.py), trained on pre-generated groups with nothing else in the
process: no sockets, no feeder thread, no admission, no weight push, no waiting. Two sources of batches:

* the engine alone's groups (the limit, scripts/pipeline_limit.py), taken in ticket order, ``rollout_batch_size``
  groups each, as the staleness buffer hands them out (:func:`ticket_batches`): the starting policy's answers;
* a finished run's own batches (:func:`trained_batches`, ``--replay``): exactly the groups each of its steps
  trained. The policy a run learns writes other lengths than the starting one (on ``data=long`` longer workings at
  some seeds), so this is the learner's work in that very run, and the run's time against it is the pipeline's
  own overhead: waiting, bookkeeping, and sharing the machine.
"""

from __future__ import annotations

import json
import os
import time

import torch

from asyncppo.config.devices import learner_on_gpu
from asyncppo.learner.batch import collate_groups
from asyncppo.learner.build import build_models
from asyncppo.stream.group_file import read_groups


def ticket_batches(groups: list, per_batch: int, steps: int | None = None) -> list[list]:
    """``steps`` batches (default: as many whole ones as ``groups`` hold) of ``per_batch`` groups in ticket order,
    as the staleness buffer hands them out."""
    ordered = sorted(groups, key=lambda g: g.ticket)
    steps = len(ordered) // per_batch if steps is None else int(steps)
    if steps < 1 or steps * per_batch > len(ordered):
        raise ValueError(f"learner alone: {len(ordered)} groups cannot fill {steps} batches of "
                         f"rollout.rollout_batch_size={per_batch}")
    return [ordered[i * per_batch:(i + 1) * per_batch] for i in range(steps)]


def trained_batches(run_dir: str) -> list[list]:
    """A finished run's own batches, step by step, from ``trained_groups.jsonl`` and ``trained_groups.bin``
    (``trainer.save_trained_groups``): the groups each step trained, in the order it took them, whatever order
    they arrived in. A step trained twice (again after a resume from an earlier checkpoint) counts as its last
    training, the one the final weights saw."""
    blob = os.path.join(run_dir, "trained_groups.bin")
    if not os.path.exists(blob):
        raise FileNotFoundError(f"{blob}: no trained groups were kept; launch the run with "
                                "trainer.save_trained_groups=true")
    by_id = {g.group_id: g for g in read_groups(blob)}
    steps: dict[int, list] = {}
    with open(os.path.join(run_dir, "trained_groups.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            missing = [gid for gid, _, _ in rec["groups"] if gid not in by_id]
            if missing:
                raise ValueError(f"{run_dir}: step {rec['step']} trained groups not in trained_groups.bin "
                                 f"(e.g. {missing[0]!r}); was save_trained_groups off for part of the run?")
            steps[rec["step"]] = [by_id[gid] for gid, _, _ in rec["groups"]]
    return [steps[k] for k in sorted(steps)]


def train_alone(cfg, model_path: str, batches: list[list]) -> dict:
    """Train one update per batch of groups (:func:`ticket_batches`, :func:`trained_batches`) and time each one,
    from the collation of its batch to the end of the update. Returns ``learner_s`` (their sum), ``step_s``
    (each), ``steps`` and ``samples``."""
    from transformers import AutoTokenizer  # heavy: transformers

    if not batches:
        raise ValueError("learner alone: no batches to train")
    torch.manual_seed(cfg.trainer.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and learner_on_gpu(cfg) else "cpu")
    models = build_models(cfg, model_path, None, device, 0, 1)
    pad = AutoTokenizer.from_pretrained(model_path).pad_token_id
    step_s, samples = [], 0
    for groups in batches:
        t0 = time.perf_counter()
        batch = collate_groups(groups, pad)
        models.updater.step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        samples += batch.size
    return {"learner_s": sum(step_s), "step_s": step_s, "steps": len(batches), "samples": samples}
