"""The learner's admission server gets the per-worker ticket cap of its workload (staleness/fairness.py:
``auto_ticket_cap``): engine-slot sized for single-turn groups, the staleness window for multi-turn episodes,
and ``cluster.max_tickets_per_worker`` when set. Real sockets, bound on loopback and closed again."""

from __future__ import annotations

import pytest

from asyncppo.config import load_config
from asyncppo.launch.learner_sockets import LearnerSockets


def _cap(*overrides: str) -> int:
    cfg = load_config(["rollout.max_num_seqs=64", "rollout.rollout_batch_size=4", "rollout.max_staleness=8",
                       *overrides])
    closables: list = []
    try:
        sockets = LearnerSockets(cfg, "127.0.0.1", None, num_workers=1, start_version=0, sync_backend="gloo",
                                 closables=closables)
        return sockets.admission_server.max_tickets_per_peer
    finally:
        for c in reversed(closables):
            c.close()


@pytest.mark.parametrize("overrides, cap", [
    # 64 slots / 8 samples a group = 8 groups of room: 2 x 8 + 2
    (["data=addition", "rollout.num_return_sequences_in_group=8"], 18),
    # episodes behind a tool: the window (j + 1) x B, with j = k = 8 and with a lookahead j = 2
    (["data=guess", "rollout.num_return_sequences_in_group=8"], 36),
    (["data=guess", "rollout.num_return_sequences_in_group=8", "rollout.admission_lookahead=2"], 12),
    # set by hand: kept as given
    (["data=guess", "rollout.num_return_sequences_in_group=8", "cluster.max_tickets_per_worker=5"], 5),
])
def test_the_admission_server_gets_its_workloads_ticket_cap(overrides, cap):
    assert _cap(*overrides) == cap
