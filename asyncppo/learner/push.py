"""Rank 0's weight push to the rollout workers, and the unsharded actor copy it keeps up to date on the way.

Why a module of its own: the learner loop only needs "push version ``v``" and "make ``plain_actor`` current"; how
that happens depends on whether the actor is sharded over several learner ranks and on
``trainer.weight_push_gather``:

* one rank: the actor's full ``state_dict`` goes to the fan-out (sync/fanout.py), which snapshots it and pushes in
  the background;
* several ranks, ``whole`` (``trainer.weight_push_gather``): the shards are gathered (collective) into
  ``plain_actor`` and that is pushed;
* several ranks, ``layer_groups``: layer groups are streamed as they are gathered (learner/gather.py), so rank 0 holds
  at most ``trainer.weight_push_budget_mb`` of them besides ``plain_actor`` instead of the gathered model plus a
  snapshot; the fan-out then keeps no snapshot, so a worker joining later is pushed at the next step.

Every gathered group is also copied into ``plain_actor`` (rank 0's unsharded copy, used for evaluation and
checkpoints), so a push leaves it current too.
"""

from __future__ import annotations

import torch

from asyncppo.learner import distributed as D
from asyncppo.learner.gather import iter_full_groups, push_layer_groups
from asyncppo.learner.models import full_state_dict
from asyncppo.sync.group import stages_on_host


class WeightPusher:
    """Pushes ``actor``'s weights through ``sender`` (a :class:`~asyncppo.sync.fanout.WeightFanout`) and keeps
    ``plain_actor`` (the actor itself on one rank) in step with the shards."""

    def __init__(self, actor, plain_actor, sender, *, multi: bool, gather_mode: str, budget_bytes: int,
                 state_of=full_state_dict):
        """``state_of(actor)``: the tensors one rank pushes (a LoRA actor: its adapters, learner/lora.py)."""
        self.actor = actor
        self.state_of = state_of
        self.plain_actor = plain_actor
        self.sender = sender
        self.multi = multi
        self.streamed = multi and gather_mode == "layer_groups"
        self.budget_bytes = budget_bytes
        self.plain_state = plain_actor.state_dict()  # shares storage with plain_actor's parameters

    def mirror(self, named) -> None:
        """Copy one gathered layer group into rank 0's unsharded copy (eval, checkpoints)."""
        with torch.no_grad():
            for name, tensor in named:
                self.plain_state[name].copy_(tensor)

    def actor_state(self) -> dict:
        """Refresh plain_actor from the shards, one layer group at a time (no second full copy on rank 0);
        with one rank, the actor's own full state dict. Collective when sharded."""
        if not self.multi:
            return self.state_of(self.actor)
        D.broadcast_gather(0)
        for named in iter_full_groups(self.actor, 0):
            self.mirror(named)
            del named
        return self.plain_state

    def push(self, version: int) -> None:
        """Send the current weights as ``version`` to every worker (background, except the streamed gather)."""
        if not self.streamed:
            self.sender.push_async(self.actor_state(), version)
            return
        D.broadcast_gather(0)
        push_layer_groups(self.sender, self.actor, version, self.budget_bytes,
                          device=torch.device("cpu") if stages_on_host(self.sender.backend) else None, on_group=self.mirror)
