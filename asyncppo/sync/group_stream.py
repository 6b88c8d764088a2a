"""One producer, several push threads: named tensors handed over group by group within a byte budget.

Why. A whole-model snapshot per push costs rank 0 a full copy of the model. When the tensors are produced one layer
group at a time (a gather of a sharded model, asyncppo/learner/gather.py), each group can be handed to every
member's push thread and freed once all of them sent it. The producer asks for room before it makes the next group
(:meth:`GroupStream.wait_room`), so the bytes held never exceed ``budget_bytes``, or one group when a single group
is larger than the budget: the producer blocks (it is the learner's push point) until the slowest member caught up.

A member that dies or is retired while the producer waits is dropped by the ``alive`` check (polled), so a dead
worker cannot stall the learner; one that is alive but never takes its push fails its own broadcast at the sync
group's timeout and is dropped then. If the producer fails, :meth:`abort` wakes every member with the error.
Nothing here knows about models or PPO: a group is a list of ``(index, tensor)`` in push order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Optional

import torch

from asyncppo.sync.layout import TensorMeta


class GroupStreamAborted(RuntimeError):
    """The producer failed before making the tensor a member asked for."""


class GroupStream:
    def __init__(self, metas: list[TensorMeta], groups: list[list[int]], consumers: Iterable[Hashable],
                 budget_bytes: int, alive: Optional[Callable[[Hashable], bool]] = None,
                 on_release: Optional[Callable[[int], None]] = None):
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes={budget_bytes} must be >= 1")
        if sorted(i for g in groups for i in g) != list(range(len(metas))):
            raise ValueError("groups must cover every tensor index exactly once")
        self.metas, self.groups, self.budget = list(metas), [list(g) for g in groups], int(budget_bytes)
        self._group_of = {i: k for k, g in enumerate(self.groups) for i in g}
        self._bytes = [sum(self.metas[i].nbytes for i in g) for g in self.groups]
        self._alive, self._on_release = alive, on_release
        self._cond = threading.Condition()
        self._tensors: dict[int, torch.Tensor] = {}
        self._left: dict[int, dict[Hashable, int]] = {}  # group -> consumer -> tensors of it not yet sent
        self._consumers = set(consumers)
        self._made = 0  # groups produced so far
        self._held = 0  # bytes of produced groups not yet sent by every consumer
        self.peak_held = 0
        self._error: Optional[BaseException] = None

    # ------------------------------------------------------------------------------------------- producer
    @property
    def held(self) -> int:
        return self._held

    def wait_room(self, poll_s: float = 0.05) -> None:
        """Block until the next group fits the budget (or nothing is held); drop consumers no longer alive."""
        k = self._made
        with self._cond:
            while self._held and self._held + self._bytes[k] > self.budget:
                self._cond.wait(poll_s)
                if self._alive is not None:
                    for c in [c for c in self._consumers if not self._alive(c)]:
                        self._drop_locked(c)

    def put(self, tensors: list[tuple[int, torch.Tensor]]) -> None:
        """Hand over the next group: ``(index, tensor)`` for exactly the indices of ``groups[k]``."""
        k = self._made
        if sorted(i for i, _ in tensors) != sorted(self.groups[k]):
            raise ValueError(f"group {k}: got tensors {sorted(i for i, _ in tensors)}, expected {self.groups[k]}")
        with self._cond:
            for i, t in tensors:
                self._tensors[i] = t
            self._left[k] = {c: len(self.groups[k]) for c in self._consumers}
            self._held += self._bytes[k]
            self.peak_held = max(self.peak_held, self._held)
            self._made += 1
            if not self._left[k]:
                self._free_locked(k)
            self._cond.notify_all()

    def abort(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            for k in list(self._left):
                self._free_locked(k)
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------- consumers
    def get(self, consumer: Hashable, index: int) -> torch.Tensor:
        """Tensor ``index``, waiting until its group is produced."""
        k = self._group_of[index]
        with self._cond:
            while self._made <= k and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise GroupStreamAborted(f"the producer failed before tensor {self.metas[index].name}: "
                                         f"{self._error}") from self._error
            return self._tensors[index]

    def sent(self, consumer: Hashable, index: int) -> None:
        """``consumer`` has every byte of tensor ``index`` on the wire."""
        k = self._group_of[index]
        with self._cond:
            left = self._left.get(k)
            if left is None or consumer not in left:
                return
            left[consumer] -= 1
            if left[consumer] == 0:
                del left[consumer]
                if not left:
                    self._free_locked(k)

    def drop(self, consumer: Hashable) -> None:
        """``consumer`` will take nothing more (it failed or left)."""
        with self._cond:
            self._drop_locked(consumer)

    # ------------------------------------------------------------------------------------------- internals
    def _drop_locked(self, consumer: Hashable) -> None:
        self._consumers.discard(consumer)
        for k in list(self._left):
            left = self._left[k]
            if left.pop(consumer, None) is not None and not left:
                self._free_locked(k)
        self._cond.notify_all()

    def _free_locked(self, k: int) -> None:
        if self._left.pop(k, None) is None:
            return
        for i in self.groups[k]:
            self._tensors.pop(i, None)
        self._held -= self._bytes[k]
        if self._on_release is not None:
            self._on_release(self._bytes[k])
        self._cond.notify_all()
