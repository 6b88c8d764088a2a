"""Fair tickets over real sockets: the real AdmissionServer and two real AdmissionClient DEALER sockets, each
asking for far more groups than the staleness window holds (an engine with max_num_seqs=256 asks for 64)."""

import time

import pytest

from asyncppo.staleness import AdmissionClient, AdmissionController, AdmissionServer

B, K = 4, 1  # window (k + 1) * B = 8 tickets in flight


def _collect(client, n, timeout_s=10.0, settle_s=0.3):
    """Exactly the tickets granted within the deadline once ``n`` arrived (and ``settle_s`` more showed none)."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += client.poll_granted(0.05)
    end = time.monotonic() + settle_s
    while time.monotonic() < end:
        got += client.poll_granted(0.05)
    return got


def _deliver(server, worker_id, tickets):
    """Their groups arrived at the learner (the feeder's ticket check)."""
    for t in tickets:
        assert server.claim(t.index, worker_id, t.min_version) is None


def test_two_greedy_workers_share_the_window(ctx):
    ctrl = AdmissionController(batch_groups=B, max_staleness=K)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=ctx, max_tickets_per_peer=130, expected_workers=2)
    a, b = AdmissionClient(server.address, 0, context=ctx), AdmissionClient(server.address, 1, context=ctx)
    try:
        a.request(64)  # the first engine up asks for its whole room: it gets its share, the rest waits for b
        first_a = _collect(a, 4)
        assert len(first_a) == 4 and ctrl.stats()["live"] == 4
        b.request(64)
        first_b = _collect(b, 4)
        assert len(first_b) == 4 and ctrl.stats()["live"] == 8 == ctrl.capacity()
        # a's groups arrive first; the next batch of capacity goes to whoever holds fewer: all 4 to a
        _deliver(server, 0, first_a)
        ctrl.set_version(1)
        second_a = _collect(a, 4)
        assert len(second_a) == 4 and _collect(b, 1, timeout_s=0.3) == []
        # everything delivered: both hold nothing, the next 4 split 2 / 2
        _deliver(server, 1, first_b)
        _deliver(server, 0, second_a)
        ctrl.set_version(2)
        assert (len(_collect(a, 2)), len(_collect(b, 2))) == (2, 2)
        assert server.granted_by_worker == {0: 10, 1: 6} and ctrl.stats()["live"] == ctrl.capacity() == 16
        busy = server.summary()["busy_by_worker"]
        assert set(busy) == {0, 1} and all(0 < f <= 1 for f in busy.values())
    finally:
        a.close(), b.close(), server.close()


def test_arrival_order_lets_the_first_worker_take_the_window(ctx):
    """The rule before fair tickets (``cluster.fair_tickets=false``): the first asker's 64 parked requests are
    served before any of the second's, so the second engine gets nothing for 64 grants."""
    ctrl = AdmissionController(batch_groups=B, max_staleness=K)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=ctx, max_tickets_per_peer=130, fair_tickets=False)
    a, b = AdmissionClient(server.address, 0, context=ctx), AdmissionClient(server.address, 1, context=ctx)
    try:
        a.request(64)
        first_a = _collect(a, 8)
        b.request(64)
        assert len(first_a) == 8 and _collect(b, 1, timeout_s=0.3) == []
        _deliver(server, 0, first_a)
        ctrl.set_version(1)
        assert len(_collect(a, 4)) == 4 and _collect(b, 1, timeout_s=0.3) == []
    finally:
        a.close(), b.close(), server.close()


def test_the_per_worker_cap_stays_hard(ctx):
    ctrl = AdmissionController(batch_groups=B, max_staleness=K)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=ctx, max_tickets_per_peer=3, expected_workers=2)
    a, b = AdmissionClient(server.address, 0, context=ctx), AdmissionClient(server.address, 1, context=ctx)
    try:
        a.request(3)
        b.request(3)
        assert (len(_collect(a, 3)), len(_collect(b, 3))) == (3, 3)
        a.request(3)
        assert _collect(a, 1, timeout_s=0.3) == [] and ctrl.stats()["live"] == 6  # two free, a capped
    finally:
        a.close(), b.close(), server.close()
