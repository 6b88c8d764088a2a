"""Nobody gets in: CURVE on the learner's ZeroMQ sockets (forced on over loopback) and stores bound to one address."""

import datetime
import socket

import numpy as np
import pytest
import torch.distributed as dist
import zmq

from asyncppo.staleness import AdmissionClient, AdmissionController, AdmissionServer
from asyncppo.stream.channels import ControlPublisher, ControlSubscriber, TrajectoryReceiver, TrajectorySender
from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.security import CurveKeys, auth_enabled, denied_handshakes, is_loopback
from asyncppo.sync.group import bound_store, find_free_port, make_sync_group


def _group(gid):
    s = Sample(np.array([1, 2], np.int32), np.array([-0.1, -0.2], np.float32), 1.0, "stop", 0, 0)
    return TrajectoryGroup(gid, 0, np.array([3], np.int32), [s], ticket=0)


def test_auth_modes():
    assert not auth_enabled("auto", "127.0.0.1") and not auth_enabled("auto", "::1")
    assert auth_enabled("auto", "0.0.0.0") and auth_enabled("auto", "10.1.2.3")
    assert auth_enabled("curve", "127.0.0.1") and not auth_enabled("off", "0.0.0.0")
    assert is_loopback("localhost") and is_loopback("[::1]") and not is_loopback("example.org")
    with pytest.raises(ValueError, match="auth mode"):
        auth_enabled("tls", "127.0.0.1")
    keys = CurveKeys.generate()
    assert keys.server_secret is not None and keys.for_workers().server_secret is None
    assert keys.server_secret not in repr(keys) and keys.client_secret not in repr(keys)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_a_refused_admission_client_gives_up_at_its_deadline_every_time():
    """A client whose CURVE handshake the server refuses gains and loses its only peer as it reconnects; acquire
    must return None by its deadline whatever moment it sends at (a blocking send after a writable poll once hung
    the suite). Each try runs in a thread, so a hang fails the test instead of stopping it."""
    import threading

    ctx = zmq.Context()
    keys = CurveKeys.generate()
    server = AdmissionServer(AdmissionController(batch_groups=4, max_staleness=0), "tcp://127.0.0.1:0",
                             context=ctx, curve=keys)
    impostor = CurveKeys.generate().for_workers()
    impostor = CurveKeys(keys.server_public, impostor.client_public, impostor.client_secret)
    try:
        for attempt in range(20):
            client = AdmissionClient(server.address, worker_id=0, context=ctx, curve=impostor)
            got: list = []
            t = threading.Thread(target=lambda: got.append(client.acquire(timeout_s=0.05 * (attempt % 4 + 1))),
                                 daemon=True)
            t.start()
            t.join(timeout=10)
            assert not t.is_alive(), f"acquire did not return by its deadline (attempt {attempt})"
            assert got == [None]
            client.close()
    finally:
        server.close()
        # term() waits for every socket: a client stuck in send would hold it, so it gets a bounded wait
        term = threading.Thread(target=ctx.term, daemon=True)
        term.start()
        term.join(timeout=10)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_a_client_without_the_keys_can_neither_push_nor_take_a_ticket_nor_read_control():
    ctx = zmq.Context()
    keys = CurveKeys.generate()
    rx = TrajectoryReceiver("tcp://127.0.0.1:0", context=ctx, curve=keys)
    pub = ControlPublisher("tcp://127.0.0.1:0", republish_interval_s=0.05, context=ctx, curve=keys)
    pub.publish(3, 2)
    ctrl = AdmissionController(batch_groups=4, max_staleness=0)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=ctx, curve=keys)
    worker_keys = keys.for_workers()
    impostor = CurveKeys.generate().for_workers()  # its own client pair, but the right server key
    impostor = CurveKeys(keys.server_public, impostor.client_public, impostor.client_secret)
    try:
        for name, k in (("no keys", None), ("unknown client key", impostor)):
            tx = TrajectorySender(rx.address, context=ctx, curve=k, linger_ms=0)
            tx.send(_group(f"{name}"), timeout_s=0.5)  # queued locally: the handshake never completes
            assert rx.recv(timeout_ms=1500) is None, name
            sub = ControlSubscriber(pub.address, context=ctx, curve=k)
            assert sub.latest(timeout_ms=1500) is None, name
            client = AdmissionClient(server.address, worker_id=0, context=ctx, curve=k)
            assert client.acquire(timeout_s=1.5) is None, name
            for x in (tx, sub, client):
                x.close()
        assert ctrl.stats()["granted"] == 0 and rx.received == 0
        assert denied_handshakes(ctx) >= 3  # the impostor's three handshakes, refused by the ZAP check
        # the run's workers, with the keys the launcher hands them, get everything
        tx = TrajectorySender(rx.address, context=ctx, curve=worker_keys, linger_ms=0)
        assert tx.send(_group("ok"), timeout_s=5)
        got = rx.recv(timeout_ms=5000)
        assert got is not None and got.group_id == "ok"
        sub = ControlSubscriber(pub.address, context=ctx, curve=worker_keys)
        state = sub.latest(timeout_ms=5000)
        assert state is not None and (state.version, state.weights_version) == (3, 2)
        client = AdmissionClient(server.address, worker_id=0, context=ctx, curve=worker_keys)
        t = client.acquire(timeout_s=5)
        assert t is not None and t.index == 0
        for x in (tx, sub, client):
            x.close()
    finally:
        for x in (server, pub, rx):
            x.close()
        ctx.term()  # returns only if the ZAP handler thread stopped with the last server


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on ``port``."""
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if state == "0A" and int(p, 16) == port:
                    out.append(addr)
    return out


def test_stores_listen_on_the_bind_address_only():
    port = find_free_port()
    store = bound_store("127.0.0.1", port, 1, datetime.timedelta(seconds=10))
    assert _listeners(port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 / ::
    client = dist.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store
    # the weight-sync group: its store and gloo's pair sockets
    port = find_free_port()
    group = make_sync_group("127.0.0.1", port, 0, 1, timeout_s=10, store_prefix="secret")
    assert _listeners(port) == ["0100007F"]
    group.close()
    # for comparison, what torch does by itself: every interface
    port = find_free_port()
    plain = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    assert _listeners(port) and "0100007F" not in _listeners(port)
    del plain


def test_bound_store_reports_a_taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(OSError):
            bound_store("127.0.0.1", s.getsockname()[1], 1, datetime.timedelta(seconds=2))
