"""The learner's models and its PPO update, as this rank holds them.

Why a module of its own: which models a run needs (a critic only for value-based estimators, a reference only
for a KL term), where each comes from (only the actor resumes from a checkpoint; the reference and a fresh critic
body always come from the configured model) and how they are sharded over the learner ranks are decided together,
once, before any training; the learner loop only uses the result.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from asyncppo.learner.lora import ADAPTER_DIR, AdaptersOff, lora_actor
from asyncppo.learner.models import learner_attention, load_actor, load_reference, maybe_shard, torch_dtype
from asyncppo.config.checks import uses_critic, uses_reference
from asyncppo.learner.ppo import PPOUpdate
from asyncppo.learner.sharding import ShardedPPOUpdate
from asyncppo.learner.value_head import build_critic
from asyncppo.models.moe_routing import RoutingHooks, check_replay


@dataclasses.dataclass
class LearnerModels:
    actor: torch.nn.Module  # sharded over the learner ranks when there are several (FSDP2)
    critic: Optional[torch.nn.Module]
    reference: Optional[torch.nn.Module]
    updater: Any  # PPOUpdate, or sharding.ShardedPPOUpdate with several ranks
    actor_path: str
    dtype: torch.dtype
    device: torch.device
    sharded: bool
    trust_remote_code: bool
    attn_implementation: str | None = None

    def unsharded_actor(self) -> torch.nn.Module:
        """The actor rank 0 evaluates and saves: a second, plain copy when the trained one is sharded (kept current
        by learner/push.py), else the actor itself."""
        if not self.sharded:
            return self.actor
        return load_actor(self.actor_path, self.dtype, self.device, self.trust_remote_code,
                          attn_implementation=self.attn_implementation)


def attach_routing(cfg, actor: torch.nn.Module, model_path: str) -> None:
    """``algorithm.routing_replay`` on: the actor's routers get their hooks (models/moe_routing.py); a model without
    mixture-of-experts routers is refused by name."""
    mode = cfg.algorithm.routing_replay
    if mode == "off":
        return
    # learner: the record is the learner's own (learner/forward.py: record_routing), not an engine's per version
    hooks = RoutingHooks.attach(actor, apply=mode in ("rollout", "learner"), by_version=mode != "learner")
    if hooks is None:
        raise ValueError(f"algorithm.routing_replay={mode}: model.path={model_path!r} has no mixture-of-experts "
                         "layers (no router with top_k and num_experts); set algorithm.routing_replay=off")
    problem = check_replay(actor, hooks, int(getattr(actor.config, "vocab_size", 2) or 2))
    if problem is not None:
        raise ValueError(f"algorithm.routing_replay={mode}: model.path={model_path!r}: {problem}; set "
                         "algorithm.routing_replay=off (docs/moe.md, which routers replay supports)")


def build_models(cfg, model_path: str, resume, device: torch.device, rank: int, world_size: int) -> LearnerModels:
    """Load (and shard, for ``world_size > 1``) the actor, the critic and the reference, and wrap them in the
    update; ``resume`` is the checkpoint being resumed from, or ``None``."""
    dtype = torch_dtype(cfg.model.dtype) if device.type == "cuda" else torch.float32
    remote = cfg.model.trust_remote_code
    lora = cfg.model.lora_rank > 0  # LoRA: the actor is always the base + adapters (a resume loads its adapter)
    actor_path = resume.actor_dir if resume is not None and not lora else model_path
    attn = learner_attention(cfg.model, device)
    actor = load_actor(actor_path, dtype, device, remote, cfg.model.gradient_checkpointing, attn)
    attach_routing(cfg, actor, model_path)
    if lora:
        actor = lora_actor(actor, cfg.model, os.path.join(resume.actor_dir, ADAPTER_DIR) if resume else None)
    actor = maybe_shard(actor, world_size, device)
    critic = (
        maybe_shard(build_critic(cfg, model_path, dtype, device, remote), world_size, device)
        if uses_critic(cfg)
        else None
    )
    reference = None
    if uses_reference(cfg):  # under LoRA the base is the actor with its adapters off: no second copy
        reference = (AdaptersOff(actor) if lora and not cfg.model.ref_path
                     else load_reference(cfg.model.ref_path or model_path, dtype, device, remote, attn))
    if world_size > 1:
        updater = ShardedPPOUpdate(cfg, actor, critic, reference, device, rank=rank, world_size=world_size)
    else:
        updater = PPOUpdate(cfg, actor, critic, reference, device)
    return LearnerModels(actor=actor, critic=critic, reference=reference, updater=updater, actor_path=actor_path,
                         dtype=dtype, device=device, sharded=world_size > 1, trust_remote_code=remote,
                         attn_implementation=attn)
