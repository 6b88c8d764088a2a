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


def test_a_parked_request_is_served_on_each_change_not_on_a_timer(ctx):
    """With the safety-net poll at a minute, only the wake-ups can serve a parked request: a version bump, a
    group's arrival (its worker at its holding cap) and a release each answer within a second; close too."""
    ctrl = AdmissionController(batch_groups=B, max_staleness=K)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=ctx, poll_ms=60_000, max_tickets_per_peer=9)
    a = AdmissionClient(server.address, 0, context=ctx)
    fast = dict(timeout_s=1.0, settle_s=0.1)
    try:
        a.request(9)
        first = _collect(a, 8, **fast)
        assert len(first) == 8 == ctrl.capacity() and server.num_pending == 1  # the window is full
        ctrl.set_version(1)  # 4 more tickets; the parked request gets one
        assert len(_collect(a, 1, **fast)) == 1 and ctrl.stats()["live"] == 9
        a.request(2)  # parked: the worker holds its cap of 9
        assert _collect(a, 1, timeout_s=0.3, settle_s=0.0) == [] and server.num_pending == 2
        _deliver(server, 0, first[:1])  # one group arrived: its worker may hold one more
        assert len(_collect(a, 1, **fast)) == 1 and ctrl.stats()["live"] == 10
        _deliver(server, 0, first[1:5])
        assert len(_collect(a, 1, **fast)) == 1 and ctrl.stats()["live"] == 11 and server.num_pending == 0
        a.request(3)  # one fits the window (12), two wait for it
        assert len(_collect(a, 1, **fast)) == 1 and ctrl.stats()["live"] == 12 and server.num_pending == 2
        assert ctrl.release(first[2])  # an arrived group dropped as stale gives its ticket back...
        assert len(_collect(a, 1, **fast)) == 1  # ...which is granted again at once
        assert server.num_pending == 1 and ctrl.stats()["live"] == 12
    finally:
        a.close()
        t0 = time.monotonic()
        server.close()
        assert time.monotonic() - t0 < 1.0
        server.close()  # a second close is harmless
        ctrl.set_version(2)  # and a change after it wakes nobody, without error
