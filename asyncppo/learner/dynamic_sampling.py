"""DAPO dynamic sampling in the streaming setting: skip prompt groups whose rewards are all equal.

Such a group has zero group-relative advantage (GRPO, RLOO, ...): it costs a forward and backward pass and moves
nothing but the KL and entropy terms. DAPO over-samples and filters; a streaming learner instead keeps pulling
groups from the stream until the batch holds ``B`` groups with signal.

Why the skipped group's ticket is *released*, not consumed: a consumed ticket keeps its admission slot for good
(:mod:`asyncppo.staleness.controller`). At most ``(k + v + 1) * B`` tickets are live, and the learner consumes
``B`` of them per version; if skipped groups were consumed too, the slots for the replacement groups would not
exist until later versions -- with ``k = 0`` the learner would wait forever. Releasing returns the slot, the
controller re-grants it with a ``min_version`` computed from the slot it now fills, so the staleness bound holds
for the replacement exactly as for any other group, and ticket-ordered consumption waits for it like for a
straggler.

Why a cap (``max_skip`` per step): when the policy solves (or fails) every prompt, every group is all-equal and the
stream would be filtered forever. After ``max_skip`` skips in one step the remaining groups are trained as they
are (harmless: their advantages are zero) and the step goes on; ``batch/skipped_groups`` shows it.
"""

from __future__ import annotations

from typing import Iterable


def rewards_all_equal(group) -> bool:
    """True when every sample of the group has the same reward (no group-relative signal)."""
    rewards = group.sample_rewards()
    return len(rewards) > 0 and all(r == rewards[0] for r in rewards)


class GroupFilter:
    """Decides, as the buffer hands each group out (``on_take``), whether it is trained or skipped, and does the
    ticket bookkeeping for both. Runs in the learner thread only (the buffer calls ``on_take`` from ``take``)."""

    def __init__(self, admission, enabled: bool, max_skip: int):
        if max_skip < 0:
            raise ValueError(f"max_skip must be >= 0, got {max_skip}")
        self.admission = admission
        self.enabled = enabled
        self.max_skip = max_skip
        self.skipped_step = 0
        self.skipped_total = 0
        self._skipped_ids: set[int] = set()

    def start_step(self) -> None:
        self.skipped_step = 0

    def on_take(self, group) -> None:
        if self.enabled and self.skipped_step < self.max_skip and rewards_all_equal(group):
            self.skipped_step += 1
            self.skipped_total += 1
            self._skipped_ids.add(id(group))
            if self.admission.is_outstanding(group.ticket):
                self.admission.release(group.ticket)  # its slot is generated again (see the module docstring)
            return
        self.admission.consumed(group.ticket)

    def keep(self, groups: Iterable) -> list:
        """The groups of a ``take`` that were not skipped."""
        kept = []
        for g in groups:
            if id(g) in self._skipped_ids:
                self._skipped_ids.discard(id(g))
            else:
                kept.append(g)
        return kept

    def metrics(self) -> dict[str, float]:
        return {"batch/skipped_groups": self.skipped_step, "batch/skipped_groups_total": self.skipped_total}
