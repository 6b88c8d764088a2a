"""The full (unsharded) weights of an FSDP2 model, gathered one layer group at a time, for a weight push.

Why. :func:`asyncppo.learner.distributed.gather_full_state_dict` materialises every full tensor on rank 0 before
the push starts, and the push then copies them once more into its snapshot: rank 0 peaks at about twice the model,
which is exactly what a model sharded because it does not fit one device cannot afford. Here the state dict is cut
into *layer groups* (the same unit the engine loads in one call, :func:`asyncppo.sync.engine_load.layer_group`,
e.g. ``model.layers.3``), and only the tensors of the groups in flight are ever full on rank 0.

What the push needs up front. The sync header lists every name, dtype and shape before any byte moves. A DTensor
knows its global shape and dtype without communication, so :func:`push_metas` computes the header from the sharded
state dict; nothing is gathered for it.

Ordering (the gather is a collective over every learner rank). :func:`iter_full_groups` must be consumed on every
rank, in the same order, in the thread that runs the other learner collectives: each ``full_tensor()`` is an
all-gather. It is therefore consumed *synchronously at the push point* (rank 0 after ``broadcast_gather``, the
followers inside ``run_follower``), before the next optimiser step, so the pushed tensors are exactly version v.
The streaming to the rollout workers overlaps with that gather (rank 0 hands each group to the push threads as soon
as it is full) and is bounded by a byte budget: rank 0 gathers the next group only while the groups that not every
worker has taken yet, plus the next one, stay within the budget (or nothing is held). The last groups stream out in
the background while training continues; they are private copies, so the optimiser cannot change them.

Followers gather each tensor and drop it at once (their peak is one full tensor); rank 0 keeps a group until every
worker took it. :class:`GatherAccounting` counts the bytes of full tensors alive on rank 0, which the tests and
``scripts/bench_push_memory.py`` assert and report.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from asyncppo.sync.engine_load import layer_group
from asyncppo.sync.layout import TensorMeta, dtype_name

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass
class GatherAccounting:
    """Bytes of gathered full tensors alive on this rank: now, at peak, and the largest single group (thread-safe:
    the gathering thread adds, the push threads release)."""

    held: int = 0
    peak: int = 0
    max_group: int = 0
    groups: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            self.max_group = max(self.max_group, nbytes)
            self.groups += 1

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor")


def push_metas(model: nn.Module) -> list[TensorMeta]:
    """Name, dtype and *global* shape of every state-dict entry, in push order, without any communication."""
    return [TensorMeta(name=n, dtype=dtype_name(t.dtype), shape=tuple(int(d) for d in t.shape))
            for n, t in model.state_dict().items()]


def group_plan(metas: list[TensorMeta]) -> list[tuple[str, list[int]]]:
    """Consecutive runs of state-dict entries with the same layer group: ``[(group, [indices]), ...]``.

    HF models list a layer's tensors together, so each group is one run; a model that interleaves groups gets
    several runs of one group (the engine loader still waits for every tensor of a group, so this stays correct).
    """
    plan: list[tuple[str, list[int]]] = []
    for i, m in enumerate(metas):
        key = layer_group(m.name)
        if plan and plan[-1][0] == key:
            plan[-1][1].append(i)
        else:
            plan.append((key, [i]))
    return plan


def group_bytes(metas: list[TensorMeta], indices: list[int]) -> int:
    return sum(metas[i].nbytes for i in indices)


def iter_full_groups(
    model: nn.Module, rank: int, accounting: Optional[GatherAccounting] = None, device: Optional[torch.device] = None,
) -> Iterator[NamedTensors]:
    """Yield, one layer group at a time, the group's full tensors on rank 0 (an empty list on other ranks).

    Collective: every rank must exhaust it in the same order (module docstring). On rank 0 each full tensor is a
    private copy (a plain, non-sharded parameter is cloned), moved to ``device`` when given (e.g. the CPU for a
    gloo push), so the caller may keep it while the model trains on. ``accounting`` counts a group's bytes when it
    is yielded; the consumer releases them (:meth:`GatherAccounting.release`) when it drops the group.
    """
    state = model.state_dict()
    names = list(state)
    for _, indices in group_plan(push_metas(model)):
        out: NamedTensors = []
        for i in indices:
            tensor = state[names[i]]
            with torch.no_grad():
                if _is_dtensor(tensor):
                    full = tensor.full_tensor()  # collective
                    if rank == 0:
                        full = full.detach().to(device) if device is not None else full.detach()
                        # a replicated DTensor may hand back its own storage: never let the optimiser reach it
                        if full.untyped_storage().data_ptr() == tensor.to_local().untyped_storage().data_ptr():
                            full = full.clone()
                else:
                    full = tensor.detach().to(device if device is not None else tensor.device, copy=True) \
                        if rank == 0 else None
            if rank == 0:
                out.append((names[i], full))
            del full
        if rank == 0 and accounting is not None:
            accounting.add(sum(t.numel() * t.element_size() for _, t in out))
        yield out
        del out


def drain(model: nn.Module, rank: int) -> None:
    """Take part in a layer-group gather without keeping anything (what a follower rank does)."""
    for _ in iter_full_groups(model, rank):
        pass


def push_layer_groups(
    fanout, model: nn.Module, version: int, budget_bytes: int, *, device: Optional[torch.device] = None,
    accounting: Optional[GatherAccounting] = None, on_group=None,
):
    """Rank 0's side of a streamed push of ``model`` as ``version`` (followers :func:`drain` in step).

    Every group is gathered in this thread (collective) only once it fits ``budget_bytes`` next to the groups that
    some worker has not taken yet, then handed to every member's push thread (``fanout.push_groups``). ``on_group``
    (optional) sees each full group first, e.g. to refresh rank 0's unsharded evaluation copy in place.
    Returns the :class:`~asyncppo.sync.group_stream.GroupStream` (its ``peak_held`` is the bytes bound).
    """
    metas = push_metas(model)
    plan = group_plan(metas)
    accounting = accounting if accounting is not None else GatherAccounting()

    def produce():
        # No reference to a group may outlive its hand-over: a loop variable would keep the previous group alive
        # while the next one is gathered, and the bound would be one group more than the accounting says.
        start = 0
        for named in iter_full_groups(model, 0, accounting, device):
            if on_group is not None:
                on_group(named)
            if any(t.is_cuda for _, t in named):  # the push threads read them on their own streams
                torch.cuda.current_stream().synchronize()
            item = [(start + j, t) for j, (_, t) in enumerate(named)]
            start += len(named)
            del named
            yield item
            del item

    return fanout.push_groups(metas, [idx for _, idx in plan], produce(), version, budget_bytes,
                              on_release=accounting.release)
