"""Checkpoints of embodied runs: the actor-critic, its optimiser, the version and the return window, in one file.

Why not learner/checkpoint.py's format: that one is built around a Hugging Face actor directory the rollout engines
load, a tokenizer and a critic; an embodied policy is one small network that the env workers receive over the weight
sync (a resumed learner pushes it before any ticket is served), so one ``torch.save`` file is all a resume needs.
The directory layout and its guarantees are the same: ``<output_dir>/checkpoints/step_<N>/`` written under a
temporary name and renamed, ``latest`` naming the newest, the newest ``trainer.keep_checkpoints`` kept. Env workers
draw no dataset, so there is no data position: a resume loses only the segments in flight, which cost env steps,
not prompts.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from asyncppo.learner.checkpoint import (META_FILE, CheckpointError, _complete_steps, checkpoints_root, publish,
                                         writing)
from asyncppo.learner.run_files import read_latest

POLICY_FILE = "policy.pt"
KIND = "embodied"


def save_embodied(output_dir: str, version: int, state: dict[str, Any], keep: int = 2) -> str:
    """Write ``state`` (plain tensors, numbers and lists: it is read back with ``weights_only=True``) as the
    checkpoint of ``version``; returns its directory."""
    with writing(output_dir, version) as (root, name, tmp):
        torch.save(dict(state, version=int(version)), os.path.join(tmp, POLICY_FILE))
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
            json.dump({"kind": KIND, "version": int(version), "saved_at": time.time()}, f)
        return publish(root, tmp, name, keep)


def resolve_embodied(path: str) -> tuple[str, int]:
    """``(checkpoint dir, version)`` for ``path``: a ``step_N`` directory, a ``checkpoints/`` directory or a run
    directory (its ``latest``, else its newest complete checkpoint); :class:`CheckpointError` names what is missing."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, POLICY_FILE)):
        return path, _version(path)
    for root in (checkpoints_root(path), path):
        name = read_latest(root) or next((n for _, n in reversed(_complete_steps(root))), None)
        if name and os.path.isfile(os.path.join(root, name, POLICY_FILE)):
            return os.path.join(root, name), _version(os.path.join(root, name))
    raise CheckpointError(f"trainer.resume_from={path!r}: no embodied checkpoint found (looked for {POLICY_FILE} "
                          "there and under checkpoints/latest); embodied runs write them when trainer.save_every > 0")


def _version(ckpt_dir: str) -> int:
    with open(os.path.join(ckpt_dir, META_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("kind") != KIND:
        raise CheckpointError(f"checkpoint {ckpt_dir!r} is not an embodied run's checkpoint")
    return int(meta["version"])


def load_embodied(ckpt_dir: str) -> dict[str, Any]:
    return torch.load(os.path.join(ckpt_dir, POLICY_FILE), map_location="cpu", weights_only=True)
