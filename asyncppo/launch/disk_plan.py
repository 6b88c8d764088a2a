"""The disk a run's checkpoints take, against the space free where they go, told before the run starts.

Why: a checkpoint holds the actor, its AdamW moments and a critic with its own (Qwen2.5-7B in bfloat16: ~43 GiB,
~85 GiB with a critic); ``trainer.keep_checkpoints`` of them stay, and a new one is written in full before the
oldest is pruned. A disk that cannot hold that is found at the first save that fails, hours in; the learner then
trains on without it (learner/loop.py ``_checkpoint``), but every checkpoint missed is steps a crash would cost.
Pure arithmetic on the model's shape (launch/memory_plan.py's) and the options, like the memory split; a warning,
not a refusal: space can be freed while a run goes, and the estimate is deliberately simple.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from asyncppo.config.devices import learner_on_gpu, learner_ranks
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.launch.memory_plan import DTYPE_BYTES, GIB, LearnerLoad, ModelShape, optimizer_bytes
from asyncppo.launch.shared_device import learner_load, model_shape
from asyncppo.learner.run_files import disk_usage_near


def checkpoint_bytes(shape: ModelShape, load: LearnerLoad) -> int:
    """One checkpoint: the actor in the learner's dtype (with LoRA, the merged model and its adapters in float32),
    AdamW's two moments of what trains, and a separate critic's weights and moments. The trainer state's other
    parts (schedulers, RNG, data position) are small."""
    params = shape.params()
    weights = params * load.dtype_bytes
    if load.adapter_params:
        actor, optimizer = weights + load.adapter_params * 4, load.adapter_params * 8
    else:
        actor, optimizer = weights, params * load.optimizer_bytes_per_param
    critic = weights + params * load.optimizer_bytes_per_param if load.critic else 0
    return actor + optimizer + critic


def free_bytes(path: str) -> Optional[int]:
    """Free bytes on the filesystem that holds ``path`` (its nearest existing directory); None if unreadable."""
    usage = disk_usage_near(path)
    return usage.free if usage else None


def disk_lines(cfg: AsyncPPOConfig, output_dir: str,
               free: Callable[[str], Optional[int]] = free_bytes) -> tuple[list[str], Optional[str]]:
    """(what ``--dry-run`` prints, a warning when the run's checkpoints and final model need more than is free at
    ``output_dir``, or None). Nothing for runs without checkpoints, embodied runs (kilobytes) or an unreadable
    model shape."""
    tr = cfg.trainer
    shape = model_shape(cfg.model.path) if tr.save_every and not cfg.env.id else None
    if shape is None:
        return [], None
    load = learner_load(cfg, shape)
    dtype_bytes = DTYPE_BYTES.get(cfg.model.dtype, 4) if learner_on_gpu(cfg) else 4  # the CPU learner: float32
    load = dataclasses.replace(load, dtype_bytes=dtype_bytes, optimizer_bytes_per_param=optimizer_bytes(dtype_bytes))
    one = checkpoint_bytes(shape, load)
    if learner_ranks(cfg) > 1:  # the shards hold the actor as well as the gathered HF copy the engines load
        one += shape.params() * dtype_bytes
    at_once = tr.keep_checkpoints + 1  # the newest is written in full before the oldest is pruned
    need = at_once * one + shape.params() * dtype_bytes  # and final/, the trained model
    have = free(output_dir)
    line = (f"checkpoints: ~{_size(one)} each, up to {at_once} on disk while the newest is written "
            f"(trainer.keep_checkpoints={tr.keep_checkpoints}), ~{_size(need)} in all with the final model; "
            + (f"{_size(have)} free there" if have is not None else "free space unknown"))
    warning = None
    if have is not None and need > have:
        warning = (f"WARNING: this run's checkpoints need ~{_size(need)} at {output_dir} but "
                   f"{_size(have)} are free: free space, lower trainer.keep_checkpoints, or choose a "
                   f"trainer.output_dir on a larger disk (a checkpoint that cannot be written is skipped with a "
                   f"warning and the run trains on)")
    return [line], warning


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"
