"""Actor, critic and reference models for the learner.

The critic is a separate value model: the policy's transformer body (or one loaded from ``model.critic_path``) with a
scalar head, so the actor's and critic's optimisers and learning rates stay independent, as in verl and OpenRLHF.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from asyncppo.learner import varlen_sdpa  # noqa: F401  registers the sdpa_varlen attention with transformers

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def disable_dropout(model: nn.Module) -> nn.Module:
    """PPO ratios compare forward passes of the same weights: dropout would make the first-pass ratio differ from 1."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def learner_attention(model_cfg, device: torch.device) -> str | None:
    """The attention kernel the learner's models load with: ``model.attn_implementation`` when set; left null, on a
    CPU learner ``sdpa_varlen`` (packed rows filled to the token budget, one causal sdpa call per sequence:
    learner/varlen_sdpa.py; padded forwards go to sdpa unchanged), elsewhere transformers' own choice. A remote-code
    model keeps its own attention (it may not go through transformers' attention interface)."""
    if model_cfg.attn_implementation is not None:
        return model_cfg.attn_implementation
    if device.type == "cpu" and not model_cfg.trust_remote_code:
        return varlen_sdpa.NAME
    return None


def _attention(attn_implementation: str | None) -> dict:
    """``from_pretrained``'s attention argument: none (transformers' own choice, sdpa where it can) unless set
    (``model.attn_implementation``; packing reads the choice back from the model's config)."""
    return {"attn_implementation": attn_implementation} if attn_implementation else {}


def load_actor(
    path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
    gradient_checkpointing: bool = False, attn_implementation: str | None = None,
) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 **_attention(attn_implementation))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return disable_dropout(model).to(device)


def load_reference(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
                   attn_implementation: str | None = None) -> nn.Module:
    model = load_actor(path, dtype, device, trust_remote_code, attn_implementation=attn_implementation)
    model.eval()
    model.requires_grad_(False)
    return model


class ValueModel(nn.Module):
    """Transformer body + linear head giving one value per position."""

    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.value_head = nn.Linear(hidden_size, 1)
        # A zero head starts the critic at V = 0: explained variance starts at 0, not at a random negative number.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)


def load_critic(
    path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> ValueModel:
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    body = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                     **_attention(attn_implementation))
    critic = ValueModel(disable_dropout(body), config.hidden_size).to(device=device)
    critic.value_head.to(torch.float32)
    return critic


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain (unsharded) state dict: FSDP2 parameters are DTensors whose full tensor is gathered (collective).

    This holds the whole model at once; a push of a sharded model streams layer groups instead
    (asyncppo/learner/gather.py)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach()
    return out


def maybe_shard(model: nn.Module, world_size: int, device: torch.device) -> nn.Module:
    """FSDP2 (one unit per decoder layer, then the root) whenever the learner has more than one rank; a no-op on one.

    On CPU too: ``fully_shard`` runs with gloo in torch 2.13 (tests/component/test_learner_fsdp_push.py), and it is what
    averages the gradients over ranks (ShardedPPOUpdate relies on it), so several ranks without it would train
    diverging copies. ``device`` is kept for callers; the mesh follows the default process group's backend."""
    del device
    if world_size <= 1:
        return model

    layers: Optional[nn.ModuleList] = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            layers = module
            break
    if layers is not None:
        for layer in layers:
            fully_shard(layer)
    head = getattr(model, "value_head", None)
    if head is not None:  # the critic's float32 head: FSDP needs one dtype per parameter group
        fully_shard(head)
    fully_shard(model)
    return model
