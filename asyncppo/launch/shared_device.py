"""``--gpus N``: what the launcher settles before a shared-device run starts.

Each of the N devices holds one rollout engine and one learner rank at the same time (launch/plan.py places them in
one Ray bundle of one GPU, each actor asking for half of it; on CPU the bundle has no GPU and the two processes
share the host). This module settles ``cluster.shared_device=auto`` (so every actor receives ``cuda`` or ``cpu``),
finds one device's memory and the model's shape, and asks launch/memory_plan.py for the split, which ``--dry-run``
prints and which refuses an impossible run by name (exit 2) before Ray starts. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
from typing import Callable, Optional

from asyncppo.config.checks import mini_batch_prompts, uses_critic
from asyncppo.config.devices import learner_ranks
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.launch.memory_plan import (
    DTYPE_BYTES, GIB, LearnerLoad, ModelShape, describe_unknown, micro_batch_tokens, optimizer_bytes,
    shape_from_config, split_memory,
)


class SharedSplitError(ValueError):
    """The model and its optimizer do not fit beside the engine; the message names the option to change."""


def nvidia_gpu_present() -> bool:
    """Whether this machine shows an NVIDIA GPU to this process (the driver's device nodes, not torch: the launcher
    must stay fast and work without CUDA torch)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"))


def resolve_shared_device(cfg: AsyncPPOConfig, gpu_present: Callable[[], bool] = nvidia_gpu_present) -> \
        AsyncPPOConfig:
    """``cluster.shared_device=auto`` becomes ``cuda`` or ``cpu`` (a config without ``--gpus`` is returned as is)."""
    cl = cfg.cluster
    if cl.shared_gpus <= 0 or cl.shared_device != "auto":
        return cfg
    device = "cuda" if gpu_present() else "cpu"
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cl, shared_device=device))


def device_memory_bytes(cfg: AsyncPPOConfig) -> Optional[float]:
    """One device's memory: ``cluster.device_memory_gib``, else the smallest GPU ``nvidia-smi`` reports; None on CPU
    without the option, or where nvidia-smi is missing."""
    if cfg.cluster.device_memory_gib > 0:
        return cfg.cluster.device_memory_gib * GIB
    if cfg.cluster.shared_device != "cuda":
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        mib = [float(x) for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(mib) * (1 << 20) if mib else None


def model_shape(model_path: str) -> Optional[ModelShape]:
    """The shape from ``model_path/config.json``, or from the built-in model's recipe (its tiny vocabulary is a
    few dozen symbols); None when neither is readable."""
    if model_path.startswith("builtin:"):
        from asyncppo.data.tasks import get_task  # light: no torch
        from asyncppo.data.tiny import BUILTIN_MODELS, CHAT_SPECIAL_TOKENS, SPECIAL_TOKENS  # light: no torch

        spec = BUILTIN_MODELS.get(model_path.split(":", 1)[1])
        if spec is None:
            return None
        h, heads = spec["hidden"], spec["heads"]
        specials = SPECIAL_TOKENS + (CHAT_SPECIAL_TOKENS if spec.get("chat") else [])
        vocab = len(specials) + len(get_task(spec["task"]).alphabet())  # the character tokenizer
        return ModelShape(vocab=vocab, hidden=h, layers=spec["layers"],
                          heads=heads, kv_heads=heads, head_dim=h // heads, intermediate=spec["intermediate"],
                          tied=False)
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return shape_from_config(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def learner_load(cfg: AsyncPPOConfig, shape: Optional[ModelShape] = None) -> LearnerLoad:
    """What one learner rank holds, from the options (launch/memory_plan.py's rules)."""
    a, ro = cfg.algorithm, cfg.rollout
    dtype_bytes = DTYPE_BYTES.get(cfg.model.dtype, 4) if cfg.cluster.shared_device == "cuda" else 4
    rows = a.micro_batch_size or mini_batch_prompts(cfg) * ro.num_return_sequences_in_group
    tokens = micro_batch_tokens(rows, a.max_tokens_per_micro_batch, ro.prompt_length + ro.response_length)
    # under LoRA the reference is the actor with its adapters switched off (learner/lora.py): no second copy
    lora = cfg.model.lora_rank > 0
    reference = (a.use_kl_loss or a.add_token_level_kl) and not (lora and not cfg.model.ref_path)
    # model.shared_backbone on one rank: the critic is a value head on the actor (learner/value_head.py), ~free
    value_head_only = cfg.model.shared_backbone and learner_ranks(cfg) <= 1
    return LearnerLoad(dtype_bytes=dtype_bytes, optimizer_bytes_per_param=optimizer_bytes(dtype_bytes),
                       critic=uses_critic(cfg) and not value_head_only, reference=bool(reference),
                       micro_batch_tokens=tokens,
                       gradient_checkpointing=cfg.model.gradient_checkpointing,
                       adapter_params=shape.adapter_params(cfg.model.lora_rank, list(cfg.model.lora_target_modules))
                       if lora and shape is not None else 0)


def check_shared_split(cfg: AsyncPPOConfig) -> list[str]:
    """The lines ``--dry-run`` prints; raises :class:`SharedSplitError` for a split that cannot work. The device's
    memory is asked once (``nvidia-smi`` when not configured), also when the answer only picks the message."""
    if cfg.cluster.shared_gpus <= 0:
        return []
    device, shape = device_memory_bytes(cfg), model_shape(cfg.model.path)
    if device is None:
        return describe_unknown("set cluster.device_memory_gib to estimate it")
    if shape is None:
        return describe_unknown(f"no config.json readable at model.path={cfg.model.path!r} yet")
    engine_bytes = DTYPE_BYTES.get(cfg.rollout.dtype, 4)
    split = split_memory(shape, device, cfg.rollout.gpu_memory_utilization, engine_bytes, learner_load(cfg, shape))
    if split.problem:
        raise SharedSplitError(f"--gpus {cfg.cluster.shared_gpus}: {split.problem}")
    return split.lines()
