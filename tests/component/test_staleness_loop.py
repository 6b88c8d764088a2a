"""A simulated generator loop over real sockets: admission tickets, control channel, trajectory stream, buffer.

Workers stamp each group with the version of the weights they hold. They update those weights only when a ticket
forces them to (``min_version``), waiting on the control channel until that version is published: the laziest
legal worker, i.e. the one that produces the stalest data the rules allow.
"""

import threading
import time

import numpy as np
import pytest
import zmq

from asyncppo.staleness import AdmissionClient, AdmissionController, AdmissionServer, Feeder, StalenessBuffer
from asyncppo.stream.channels import ControlPublisher, ControlSubscriber, TrajectoryReceiver, TrajectorySender
from asyncppo.stream.records import Sample, TrajectoryGroup

B, WORKERS, STEPS = 4, 3, 8


def worker(wid, ctx, adm_addr, ctl_addr, traj_addr, log):
    client = AdmissionClient(adm_addr, wid, context=ctx)
    sub = ControlSubscriber(ctl_addr, context=ctx)
    tx = TrajectorySender(traj_addr, hwm=4, context=ctx)
    held, seq = 0, 0
    try:
        while True:
            t = client.acquire(timeout_s=20)
            if t is None:
                break
            if held < t.min_version:
                s = sub.wait_for(lambda s: s.version >= t.min_version or s.stop, timeout_s=20)
                if s is None or s.stop:
                    break
                held = s.version
            time.sleep(0.002 * (1 + wid))  # "generate"
            samples = [Sample(np.arange(5, dtype=np.int32), np.zeros(5, np.float32), 1.0, "stop", held, held)
                       for _ in range(2)]
            g = TrajectoryGroup(f"{wid}-{seq}", wid, np.zeros(3, np.int32), samples, ticket=t.index)
            seq += 1
            log.append((t.index, t.min_version, held))
            if not tx.send(g, timeout_s=20):
                break
    finally:
        client.close()
        sub.close()
        tx.close(linger_ms=0)


@pytest.mark.parametrize("k", [0, 1, 4])
def test_lag_is_bounded_by_k(k):
    ctx = zmq.Context()
    ctrl = AdmissionController(B, k)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=ctx)
    pub = ControlPublisher("tcp://127.0.0.1:0", republish_interval_s=0.05, context=ctx)
    pub.publish(0, 0)
    rx = TrajectoryReceiver("tcp://127.0.0.1:0", hwm=4, context=ctx)
    buf = StalenessBuffer(k, capacity_groups=2 * B,
                          on_drop=lambda g: ctrl.release(g.ticket), on_take=lambda g: ctrl.consumed(g.ticket))
    feeder = Feeder(rx, buf, poll_ms=20)
    log: list = []
    threads = [threading.Thread(target=worker, args=(w, ctx, server.address, pub.address, rx.address, log))
               for w in range(WORKERS)]
    for th in threads:
        th.start()
    lags, max_in_flight, max_ahead = [], 0, 0
    for v in range(STEPS):
        batch = buf.take(B, learner_version=v, timeout_s=30)
        assert len(batch) == B
        lags += [v - s.version_min for g in batch for s in g.samples]
        st = buf.stats()
        assert st["lag_max"] <= k
        time.sleep(0.05)  # a slow learner step: the workers may run ahead meanwhile
        stats = ctrl.stats()
        max_in_flight = max(max_in_flight, stats["in_flight"])
        max_ahead = max(max_ahead, stats["live"] - (v + 1) * B)  # tickets beyond the current batch
        ctrl.set_version(v + 1)
        pub.publish(v + 1, v + 1)
    server.stop()
    pub.publish(STEPS, STEPS, stop=True)
    for th in threads:
        th.join(30)
        assert not th.is_alive()
    feeder.close()
    for x in (server, pub, rx):
        x.close()
    ctx.destroy(linger=0)

    assert len(lags) == STEPS * B * 2
    assert max(lags) <= k
    # every grant obeyed the formula at the time it was made, and workers held what the ticket required
    assert all(held >= m for _, m, held in log)
    if k == 0:
        assert set(lags) == {0}
        assert max_in_flight <= B
    if k == 4:
        assert max_in_flight > B, max_in_flight  # more than one batch was being generated at once
        assert max_ahead >= B
        assert max(lags) > 0  # and it shows: some samples were trained one or more versions late
    assert set(server.rejected.values()) == {0}


def test_admission_server_waits_stops_and_ignores_garbage():
    ctx = zmq.Context()
    ctrl = AdmissionController(batch_groups=1, max_staleness=0)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=ctx)
    c = AdmissionClient(server.address, worker_id=7, context=ctx)
    bad = ctx.socket(zmq.DEALER)
    bad.connect(server.address)
    bad.send(b"\x93garbage")
    bad.send_multipart([b"a", b"b"])
    assert c.acquire(timeout_s=5).index == 0
    t0 = time.monotonic()
    assert c.acquire(timeout_s=0.2) is None  # pool empty at v=0: times out (and cancels)
    assert 0.15 < time.monotonic() - t0 < 2
    got = []
    th = threading.Thread(target=lambda: got.append(c.acquire(timeout_s=10)))
    th.start()
    time.sleep(0.1)
    ctrl.set_version(1)  # the parked request is served when the pool grows
    th.join(10)
    assert got[0] is not None and got[0].index == 1 and got[0].min_version == 1
    assert ctrl.stats()["in_flight"] == 2  # the cancelled request did not leak a ticket
    server.stop()
    assert c.acquire(timeout_s=5) is None and c.stopped
    time.sleep(0.05)
    assert server.rejected["malformed"] == 2
    bad.close(linger=0)
    c.close()
    server.close()
    ctx.destroy(linger=0)
