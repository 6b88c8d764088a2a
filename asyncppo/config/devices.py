"""Which device each role computes on, from the cluster options alone: the one rule the launcher, the learner and
the rollout worker share, so that ``--gpus N`` (one device shared by an engine and a learner rank) and the separate
pools (``--rollout-gpus`` / ``--train-gpus``) are told apart in one place.

``cluster.shared_device=auto`` is settled by the launcher before anything starts (launch/shared_device.py), so every
actor receives ``cuda`` or ``cpu`` and never guesses on its own.
"""

from __future__ import annotations

import math

from asyncppo.config.schema import AsyncPPOConfig


def shared_mode(cfg: AsyncPPOConfig) -> bool:
    """``--gpus N``: every device holds one engine and one learner rank."""
    return cfg.cluster.shared_gpus > 0


def _shared_on_cuda(cfg: AsyncPPOConfig) -> bool:
    return shared_mode(cfg) and cfg.cluster.shared_device == "cuda"


def learner_on_gpu(cfg: AsyncPPOConfig) -> bool:
    """The learner ranks hold GPUs (a separate train pool, or shared devices on CUDA)."""
    return cfg.cluster.train_gpus > 0 or _shared_on_cuda(cfg)


def engines_on_gpu(cfg: AsyncPPOConfig) -> bool:
    """The rollout engines hold GPUs (a separate rollout pool, or shared devices on CUDA)."""
    return cfg.cluster.rollout_gpus > 0 or _shared_on_cuda(cfg)


def learner_ranks(cfg: AsyncPPOConfig) -> int:
    """Learner ranks: one per train GPU, one per shared device, else one CPU learner."""
    return cfg.cluster.shared_gpus or max(1, cfg.cluster.train_gpus)


def cpu_kv_cache_space_gib(kv_cache_gib: float) -> int:
    """The ``VLLM_CPU_KVCACHE_SPACE`` a CPU vLLM engine gets for ``rollout.kv_cache_gib``: vLLM parses the variable
    as whole GiB, so the option is rounded up, and never below 1. One rule for the engine that sets the variable
    (rollout/vllm_engine.py) and the launch check that predicts what it will hold (launch/context_check.py)."""
    return max(1, int(math.ceil(kv_cache_gib)))
