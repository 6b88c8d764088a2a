"""A critic that shares the actor's body: one linear value head on the actor's final hidden states.

Why: on small models the learner's cost is counted in forward and backward passes, and a separate value model
(:class:`~asyncppo.learner.models.ValueModel`, verl's and OpenRLHF's choice) doubles them; measured on the built-in
task it is half of every update (docs/benchmarks.md, "Profile of the default PPO update"). With ``model.shared_backbone=true``
the values come out of the actor's own forward, and the value loss (times ``algorithm.vf_coef``) is added to the
actor's loss before the one backward, as in the shared-trunk actor-critics of Atari PPO and the first RLHF value heads.
The price is coupling: the value loss's gradient moves the policy's body too, and the body's learning rate is the
actor's. ``trainer.critic_lr`` applies to the head alone. The head is not part of the actor's state dict, so weight
pushes and the saved policy are unchanged; checkpoints store it as the critic.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncppo.config.devices import learner_ranks


class SharedValueHead(nn.Module):
    """V(s_t) = w . h_t + b on the actor's final hidden state ``h_t``; zero-initialised so V starts at 0."""

    shares_actor_body = True

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()


def shares_actor_body(critic: nn.Module | None) -> bool:
    return bool(getattr(critic, "shares_actor_body", False))


def uses_shared_head(cfg) -> bool:
    """Whether this run's critic is a value head on the actor: ``model.shared_backbone`` on one learner rank."""
    return bool(cfg.model.shared_backbone) and learner_ranks(cfg) <= 1


def build_critic(cfg, model_path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool) -> nn.Module:
    """The run's critic: a value head on the actor (``model.shared_backbone``, one learner rank) or a separate value
    model (several ranks: the flag has no effect there, as documented)."""
    if uses_shared_head(cfg):
        from transformers import AutoConfig  # heavy: transformers (kept off the launcher, see below)

        hidden = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).hidden_size
        return SharedValueHead(hidden).to(device)
    # ppo.py and checkpoint.py import this module for shares_actor_body, and the launcher imports those to check a
    # resume, where the model classes are never needed
    from asyncppo.learner.models import learner_attention, load_critic  # heavy: transformers

    return load_critic(cfg.model.critic_path or model_path, dtype, device, trust_remote_code,
                       learner_attention(cfg.model, device))
