"""A worker's clients survive one bad message from the server (issue #52, item 6): what a flaky link or a
half-written frame produces across hosts. Each test plays a hostile server with a raw ZeroMQ socket on loopback.

Before: one control frame over 64 KiB, or one admission reply over 4 KiB, made libzmq drop the connection for good
(a protocol error: libzmq never reconnects those), so the worker read its old control state for the rest of the
run, and its next ticket request reached nobody; ``AdmissionClient.close()`` stopped at a malformed reply and never
gave back the grant queued behind it; and the learner logged (or, with several workers, held open until the end)
evaluation rounds of points the schedule never evaluates. The tests after "Reattach" below: a grant lost with the
broken connection, or held from it, stayed with that connection on the server; and the workers' metrics did not
show the reconnects."""

from __future__ import annotations

import secrets
import time
from types import SimpleNamespace
from typing import Optional

import msgpack
import pytest
import zmq

from asyncppo.metrics.rollout import EngineTotals
from asyncppo.rollout.meter import LinkCounters
from asyncppo.staleness import AdmissionClient, AdmissionController, AdmissionServer
from asyncppo.staleness.tickets import MAXMSGSIZE, REPLY_SPEC, REQUEST_SPEC
from asyncppo.stream.channels import SMALL_MAXMSGSIZE, ControlSubscriber
from asyncppo.stream.framing import MESSAGE_SCHEMA, decode_message, encode_message


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _control(version: int, seq: int) -> bytes:
    return encode_message("control", version=version, weights_version=version, stop=False, seq=seq,
                          time=time.time())


def _until(cond, timeout_s: float = 10.0, step=None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if step is not None:
            step()
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _bind_pub(ctx: zmq.Context, port: int = 0) -> Optional[zmq.Socket]:
    """A raw PUB standing for the learner's, on ``port`` (0: any free one); None while that port is not free yet."""
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.bind(f"tcp://127.0.0.1:{port}")
    except zmq.ZMQError:
        pub.close(0)
        return None
    return pub


@pytest.fixture
def control(zctx):
    """A raw publisher (``.pub``, replaceable) and a worker's subscriber connected to it."""
    pub = _bind_pub(zctx)
    port = int(pub.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    ns = SimpleNamespace(pub=pub, port=port, sub=ControlSubscriber(f"tcp://127.0.0.1:{port}", context=zctx))
    yield ns
    ns.sub.close()
    ns.pub.close(0)


def test_a_control_frame_over_the_limit_does_not_leave_the_worker_on_its_old_state(control):
    sub, seq = control.sub, iter(range(1, 1 << 20))
    assert _until(lambda: (s := sub.latest()) is not None and s.version == 1,
                  step=lambda: control.pub.send(_control(1, next(seq))))
    control.pub.send(b"\x00" * (SMALL_MAXMSGSIZE + 1))  # one oversize frame: libzmq ends the connection for good
    time.sleep(0.3)
    # the learner goes on repeating its newest state, as ControlPublisher does every 0.2 s
    assert _until(lambda: sub.latest().version == 2, step=lambda: control.pub.send(_control(2, next(seq))))
    assert sub.reconnects == 1
    assert sub.wait_for(lambda s: s.version >= 3, timeout_s=0.01) is None  # nothing newer announced yet
    control.pub.send(_control(3, next(seq)))
    assert sub.wait_for(lambda s: s.version >= 3, timeout_s=5) is not None


def test_an_ordinary_drop_is_left_to_libzmq_and_not_counted(zctx, control):
    sub = control.sub
    assert _until(lambda: sub.latest() is not None, step=lambda: control.pub.send(_control(1, 1)))
    control.pub.close(0)  # the learner goes away (a restart): libzmq reconnects by itself
    assert _until(lambda: (setattr(control, "pub", _bind_pub(zctx, control.port)) or control.pub) is not None,
                  timeout_s=5)
    assert _until(lambda: sub.latest().version == 5, step=lambda: control.pub.send(_control(5, 2)))
    assert sub.reconnects == 0 and sum(sub.rejected.values()) == 0


class _RawServer:
    """A hand-driven admission server: a bare ROUTER whose replies the test writes byte for byte."""

    def __init__(self, ctx: zmq.Context):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAXMSGSIZE)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def next_request(self, timeout_s: float = 10.0, drive=None) -> tuple[bytes, str, dict]:
        """The next request (identity, kind, fields); ``drive`` runs between polls (a client's own loop)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if drive is not None:
                drive()
            if self.sock.poll(20):
                identity, payload = self.sock.recv_multipart()
                kind, f = decode_message(payload, REQUEST_SPEC)
                return identity, kind, f
        raise AssertionError("no request reached the server")

    def reply(self, identity: bytes, payload: bytes) -> None:
        self.sock.send_multipart([identity, payload])

    def ticket(self, identity: bytes, req: int, index: int) -> None:
        self.reply(identity, encode_message("ticket", req=req, index=index, min_version=0))

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def admission(zctx):
    """A hand-driven server and a worker's client connected to it."""
    server = _RawServer(zctx)
    client = AdmissionClient(server.address, worker_id=0, context=zctx)
    yield server, client
    client.close()
    server.close()


def test_an_admission_reply_over_the_limit_does_not_cut_the_worker_off(admission):
    import threading

    server, client = admission
    got: list = []
    t = threading.Thread(target=lambda: got.append(client.acquire(timeout_s=20)), daemon=True)
    t.start()
    identity, kind, f = server.next_request()
    assert (kind, f["req"]) == ("acquire", 1)
    server.reply(identity, b"\x00" * (MAXMSGSIZE + 1))  # libzmq drops the client's connection for good
    # the new connection reattaches to the old one, then the waiting acquire asks again: it reaches the server,
    # and its grant is taken
    identity2, kind, f = server.next_request()
    assert (kind, f) == ("reattach", {"worker_id": 0, "previous": identity}) and identity2 != identity
    identity2b, kind, f = server.next_request()
    assert (kind, f["req"], f["count"]) == ("acquire", 1, 1) and identity2b == identity2
    server.ticket(identity2, 1, index=7)
    t.join(timeout=10)
    assert not t.is_alive() and got[0] is not None and got[0].index == 7
    assert client.reconnects == 1
    # the next acquire reaches the server too
    t = threading.Thread(target=lambda: got.append(client.acquire(timeout_s=20)), daemon=True)
    t.start()
    identity3, kind, f = server.next_request()
    assert (kind, f["req"]) == ("acquire", 2) and identity3 == identity2
    server.ticket(identity3, 2, index=8)
    t.join(timeout=10)
    assert got[1] is not None and got[1].index == 8 and client.reconnects == 1


def test_requests_in_flight_are_asked_again_after_a_broken_reply(admission):
    server, client = admission
    client.request(3)
    identity, kind, f = server.next_request()
    assert (kind, f["req"], f["count"]) == ("acquire", 1, 3)
    server.ticket(identity, 1, index=0)
    assert _until(lambda: client.poll_granted() != [] or client.open_requests == 2, timeout_s=5)
    server.reply(identity, b"\xff" * (4 * MAXMSGSIZE))
    identity2, kind, f = server.next_request(drive=lambda: client.poll_granted(timeout_s=0.05))
    assert (kind, f) == ("reattach", {"worker_id": 0, "previous": identity})
    identity2b, kind, f = server.next_request(drive=lambda: client.poll_granted(timeout_s=0.05))
    assert (kind, f["req"], f["count"]) == ("acquire", 2, 2)  # the two still open, on the new connection
    assert identity2b == identity2 != identity
    server.ticket(identity2, 2, index=1)
    server.ticket(identity2, 3, index=2)
    granted: list = []
    assert _until(lambda: len(granted) == 2, step=lambda: granted.extend(client.poll_granted()))
    assert sorted(t.index for t in granted) == [1, 2] and client.open_requests == 0
    assert client.reconnects == 1


def test_close_gives_back_a_grant_queued_behind_a_malformed_reply(admission):
    server, client = admission
    client.request(1)
    identity, kind, f = server.next_request()
    assert kind == "acquire"
    garbage = msgpack.packb({"schema": MESSAGE_SCHEMA, "kind": "ticket", "req": 1})  # fields missing
    server.reply(identity, garbage)
    server.reply(identity, b"\xc1 not msgpack")
    server.ticket(identity, 1, index=5)  # a grant queued behind the bad replies
    assert client._sock.poll(5000)
    time.sleep(0.3)  # all three in the client's queue
    client.close()
    seen = [server.next_request()[1:] for _ in range(2)]
    assert seen[0] == ("cancel", {"worker_id": 0, "req": 1})
    assert seen[1] == ("release", {"worker_id": 0, "index": 5})  # before: never sent, the ticket leaked
    assert client.rejected["schema"] == 1 and client.rejected["malformed"] == 1


def test_an_evaluation_report_of_a_point_off_the_schedule_opens_no_round():
    from asyncppo.learner.evaluation import EngineEvaluation
    from asyncppo.rollout.evaluation import eval_points
    from asyncppo.stream.evals import EvalReport, EvalSender, FileScores

    records: list = []
    logger = SimpleNamespace(log=lambda step, metrics: records.append(step))
    ev = EngineEvaluation("tcp://127.0.0.1:0", num_workers=2, points=eval_points(100, 250))  # 0, 100, 200, 250
    sender = EvalSender(ev.address)
    scores = {"task.jsonl": FileScores(prompts=1, greedy_reward=1.0, sampled=1, sampled_reward=0.0, tokens=4,
                                       answers=2)}
    try:
        # point 7 is within the learner's version but never evaluated with eval_every=100; 100 is, by both workers
        for point, worker in ((7, 0), (100, 0), (100, 1)):
            assert sender.send(EvalReport(point, worker, point, point, scores), timeout_s=5)
        assert _until(lambda: ev.receiver.rejected + len(records) >= 2,
                      step=lambda: ev.poll(logger, timeout_s=0.05, version=150))
        assert records == [100] and ev.receiver.rejected == 1
        assert ev.aggregator.pending() == []  # before: point 7's round stayed open until the run ended
        assert sender.send(EvalReport(250, 1, 250, 250, scores), timeout_s=5)  # the final point is one
        assert _until(lambda: ev.aggregator.pending() == [250],
                      step=lambda: ev.poll(logger, timeout_s=0.05, version=250))
    finally:
        sender.close()
        ev.close()


# ---------------------------------------------------------------------------------------------------------------
# Reattach. A re-created admission socket is a new connection (a new ROUTER identity): a grant lost inside the broken
# frame, or held from the old connection, stayed recorded against the old one, so the worker never used it and
# could not release it (``not_holder``), and the learner, which trains tickets in order, waited for that ticket
# until the worker was retired. Now the client reattaches (staleness/server.py, "Reattach"). The real
# AdmissionServer and AdmissionClient on loopback, raw DEALER sockets playing strangers.

def _collect(client: AdmissionClient, n: int, timeout_s: float = 15.0) -> list:
    got: list = []
    assert _until(lambda: len(got) >= n, timeout_s, step=lambda: got.extend(client.poll_granted(0.05))), got
    return got


def _break_next_grant(server: AdmissionServer) -> list[int]:
    """The server's next grant goes out as one frame over the client's size limit (what a half-written frame on a
    flaky link looks like): libzmq ends the client's connection for good, and the grant inside it is lost. Returns
    the list the lost grant's index is put in. (Wraps the server's own send, in its own thread.)"""
    send, broken = server._send, []

    def send_breaking_one(identity: bytes, msg: bytes) -> bool:
        kind, f = decode_message(msg, REPLY_SPEC)
        if kind == "ticket" and not broken:
            broken.append(f["index"])
            return send(identity, msg + b"\0" * MAXMSGSIZE)
        return send(identity, msg)

    server._send = send_breaking_one
    return broken


@pytest.fixture
def ticket_server(zctx):
    ctrl = AdmissionController(batch_groups=4, max_staleness=0)  # 4 tickets in flight
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=zctx)
    yield ctrl, server
    server.close()


def test_a_grant_lost_in_a_broken_reply_is_delivered_after_the_reattach_and_released_by_the_new_connection(
        zctx, ticket_server):
    ctrl, server = ticket_server
    client = AdmissionClient(server.address, worker_id=0, context=zctx)
    try:
        client.request(1)
        (held,) = _collect(client, 1)  # received on the first connection, and kept
        broken = _break_next_grant(server)
        client.request(2)
        got = _collect(client, 2)
        assert client.reconnects == 1 and server.reattached == 1
        assert broken and broken[0] in {t.index for t in got}, (broken, got)  # the lost grant came back
        assert client.redelivered >= 1 and held.index not in {t.index for t in got}  # the held one is not doubled
        assert ctrl.stats()["live"] == 3 and ctrl.is_outstanding(held.index)
        assert sorted(server.held_by(0)) == sorted([held.index] + [t.index for t in got])
        # the new connection holds them all: a release of one held from the old connection is taken ...
        client.release(held)
        assert _until(lambda: not ctrl.is_outstanding(held.index))
        lost = next(t for t in got if t.index == broken[0])
        client.release(lost)
        assert _until(lambda: not ctrl.is_outstanding(lost.index))
        assert server.rejected["not_holder"] == 0  # before: both refused, the lost ticket outstanding for good
        # ... and the other's group is accepted as the worker's
        other = next(t for t in got if t.index != broken[0])
        assert server.claim(other.index, 0, other.min_version) is None
        assert server.num_pending == 0 and server.held_by(0) == []
        assert sum(server.rejected.values()) == 0 and sum(client.rejected.values()) == 0
    finally:
        client.close()


def test_a_blocking_acquire_whose_grant_was_lost_gets_it_after_the_reattach(zctx, ticket_server):
    ctrl, server = ticket_server
    client = AdmissionClient(server.address, worker_id=3, context=zctx)
    try:
        broken = _break_next_grant(server)
        ticket = client.acquire(timeout_s=15)
        assert ticket is not None and [ticket.index] == broken and client.reconnects == 1
        assert ctrl.stats()["live"] == 1  # the acquire asked again on the new connection: not granted twice
        assert server.claim(ticket.index, 3, ticket.min_version) is None
    finally:
        client.close()


def _dealer(ctx: zmq.Context, routing_id: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    return sock


def _reply(sock: zmq.Socket, timeout_ms: int = 5000):
    return decode_message(sock.recv(), REPLY_SPEC) if sock.poll(timeout_ms) else None


def test_a_stranger_naming_a_workers_id_or_a_made_up_connection_gets_nothing(zctx, ticket_server):
    ctrl, server = ticket_server
    honest = AdmissionClient(server.address, worker_id=0, context=zctx)
    stranger = _dealer(zctx)
    stranger.connect(server.address)
    try:
        ticket = honest.acquire(timeout_s=15)
        assert ticket is not None
        # worker 0's id is public (it is in every group id); its connection's random routing id is not
        made_up = b"asyncppo-w0-" + secrets.token_bytes(16)
        stranger.send(encode_message("reattach", worker_id=0, previous=made_up))
        stranger.send(encode_message("reattach", worker_id=0, previous=b"\0\x80\0\0\x29"))  # a libzmq-made id
        # every other shape is refused at the door, like any admission message
        for bad in ("a str", b"", b"x" * 300):
            stranger.send(encode_message("reattach", worker_id=0, previous=bad))
        stranger.send(encode_message("reattach", worker_id=0, previous=made_up, extra=1))
        stranger.send(encode_message("release", worker_id=0, index=ticket.index))
        assert _until(lambda: server.rejected["reattach"] == 2 and server.rejected["schema"] == 4
                      and server.rejected["not_holder"] == 1)
        assert _reply(stranger, 300) is None  # no grant re-sent to it
        assert server.held_by(0) == [ticket.index] and server.reattached == 0
        honest.release(ticket)  # still the holder's to give back
        assert _until(lambda: not ctrl.is_outstanding(ticket.index)) and server.rejected["not_holder"] == 1
    finally:
        honest.close()
        stranger.close()


def test_only_the_owner_of_a_connection_reattaches_to_it_and_only_once(zctx, ticket_server):
    """Raw sockets with routing ids of their own: worker 1's old connection X, its new one Y, and a stranger."""
    ctrl, server = ticket_server
    x_id, y_id = (b"asyncppo-w1-" + secrets.token_bytes(16) for _ in range(2))
    x, y, z = _dealer(zctx, x_id), _dealer(zctx, y_id), _dealer(zctx)
    for sock in (x, y, z):
        sock.connect(server.address)
    try:
        x.send(encode_message("acquire", worker_id=1, req=1, count=1))
        kind, granted = _reply(x)
        assert kind == "ticket" and granted["req"] == 1
        # naming X as another worker is refused, even with X's secret
        z.send(encode_message("reattach", worker_id=2, previous=x_id))
        assert _until(lambda: server.rejected["reattach"] == 1) and _reply(z, 300) is None
        # X's owner, on its new connection Y: X's grant moves to Y and is re-sent there with its request number
        y.send(encode_message("reattach", worker_id=1, previous=x_id))
        kind, f = _reply(y)
        assert (kind, f) == ("held", granted)
        assert server.reattached == 1 and server.held_by(1) == [granted["index"]]
        # a second reattach naming X is refused (X is forgotten): a replay, or a stranger who learnt it, gets nothing
        z.send(encode_message("reattach", worker_id=1, previous=x_id))
        assert _until(lambda: server.rejected["reattach"] == 2) and _reply(z, 300) is None
        # Y asks again for request 1, as a client does in case its reattach was refused: not granted twice
        y.send(encode_message("acquire", worker_id=1, req=1, count=1))
        y.send(encode_message("release", worker_id=1, index=granted["index"]))  # Y holds it now
        assert _until(lambda: not ctrl.is_outstanding(granted["index"]))
        assert server.rejected["not_holder"] == 0 and _reply(y, 300) is None and ctrl.stats()["granted"] == 1
    finally:
        for sock in (x, y, z):
            sock.close()


def test_a_workers_counters_show_one_reconnect_after_one_oversize_frame(zctx):
    server = _RawServer(zctx)
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub_address = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    worker = SimpleNamespace(admission=AdmissionClient(server.address, worker_id=0, context=zctx),
                             control=ControlSubscriber(pub_address, context=zctx))
    links = LinkCounters(worker)
    try:
        assert links.take() == {"reconnects_admission": 0.0, "reconnects_control": 0.0}
        worker.admission.request(1)
        identity, kind, _ = server.next_request()
        assert kind == "acquire"
        server.sock.send_multipart([identity, b"\0" * (MAXMSGSIZE + 1)])  # one oversize frame
        _, kind, _ = server.next_request(drive=lambda: worker.admission.poll_granted(0.05))
        assert kind == "reattach" and worker.admission.reconnects == 1
        assert links.take() == {"reconnects_admission": 1.0, "reconnects_control": 0.0}
        assert links.take() == {"reconnects_admission": 0.0, "reconnects_control": 0.0}  # deltas: counted once
        # the learner sums them over the step's groups, every worker's (rollout/reconnects_*, metrics.jsonl)
        group = SimpleNamespace(timings={"reconnects_admission": 1.0, "reconnects_control": 0.0},
                                sample_lengths=lambda: [3], turn_columns=lambda: None)
        other = SimpleNamespace(timings={"reconnects_admission": 0.0, "reconnects_control": 2.0},
                                sample_lengths=lambda: [3], turn_columns=lambda: None)
        metrics = EngineTotals(max_num_seqs=4).add([group, other])
        assert metrics["rollout/reconnects_admission"] == 1.0 and metrics["rollout/reconnects_control"] == 2.0
        # a restarted learner gives the worker new clients: their counts start again from zero
        worker.admission.close()
        worker.admission = AdmissionClient(server.address, worker_id=0, context=zctx)
        assert links.take() == {"reconnects_admission": 0.0, "reconnects_control": 0.0}
    finally:
        worker.admission.close()
        worker.control.close()
        pub.close(0)
        server.close()


def test_the_rollout_worker_sends_its_clients_reconnects_with_each_group():
    from asyncppo.rollout.worker import RolloutWorker

    worker = RolloutWorker.__new__(RolloutWorker)  # only what _send touches: no engine, no learner
    sent: list = []
    worker.admission, worker.control = SimpleNamespace(reconnects=1), SimpleNamespace(reconnects=0)
    worker.links, worker.stats, worker.phase, worker.progress = LinkCounters(worker), {"groups_sent": 0}, "", 0
    worker.sender = SimpleNamespace(send=lambda group, timeout_s: sent.append(dict(group.timings)) or True)
    worker._send(SimpleNamespace(timings={"gen_s": 1.0}))
    worker.control.reconnects = 2
    worker._send(SimpleNamespace(timings={"gen_s": 1.0}))
    assert sent == [{"gen_s": 1.0, "reconnects_admission": 1.0, "reconnects_control": 0.0},
                    {"gen_s": 1.0, "reconnects_admission": 0.0, "reconnects_control": 2.0}]


def test_a_socket_broken_before_its_reattach_was_answered_names_both_earlier_connections(admission):
    """Two redials before any reply: the second new socket cannot know whether the server read the first one's
    reattach, so it names both earlier connections (newest first); the server takes the one it knows and refuses,
    and counts, the other. Naming only the last one stranded the first connection's grants whenever the middle
    socket died unread (a review found it)."""
    import threading

    server, client = admission
    got: list = []
    t = threading.Thread(target=lambda: got.append(client.acquire(timeout_s=30)), daemon=True)
    t.start()
    first, kind, _ = server.next_request()
    assert kind == "acquire"
    server.reply(first, b"\x00" * (MAXMSGSIZE + 1))  # connection 1 broken: its grant, if any, is on the server
    second, kind, f = server.next_request()
    assert (kind, f["previous"]) == ("reattach", first)
    server.next_request()  # its acquire asked again
    server.reply(second, b"\x00" * (MAXMSGSIZE + 1))  # connection 2 broken before any reply reached it
    third, kind, f = server.next_request()
    assert (kind, f["previous"]) == ("reattach", second) and third not in (first, second)
    third_b, kind, f = server.next_request()
    assert (kind, f["previous"]) == ("reattach", first) and third_b == third
    _, kind, f = server.next_request()
    assert (kind, f["req"]) == ("acquire", 1)
    server.ticket(third, 1, index=5)
    t.join(timeout=10)
    assert got and got[0] is not None and got[0].index == 5 and client.reconnects == 2 and client.reattaches == 3
    # a reply confirmed the chain: a later break names only the connection that was answered
    t = threading.Thread(target=lambda: got.append(client.acquire(timeout_s=30)), daemon=True)
    t.start()
    ident, kind, _ = server.next_request()
    assert kind == "acquire" and ident == third
    server.reply(third, b"\x00" * (MAXMSGSIZE + 1))
    fourth, kind, f = server.next_request()
    assert (kind, f["previous"]) == ("reattach", third)
    _, kind, f = server.next_request()
    assert kind == "acquire", (kind, f)
    server.ticket(fourth, 2, index=6)
    t.join(timeout=10)
    assert got[1] is not None and got[1].index == 6


def test_a_socket_that_cannot_be_made_again_is_retried_after_the_backoff_and_waits_never_spin(zctx):
    """A redial whose new socket cannot be made (out of file descriptors, ...) leaves the socket closed: a poll on
    it then sleeps its timeout instead of returning at once (a caller's wait loop spun at full CPU), and the
    redialer tries again once its backoff allows, reconnecting when it can."""
    import errno

    from asyncppo.stream.redial import Redialer

    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    fail = {"on": False, "tries": 0}

    def make() -> zmq.Socket:
        if fail["on"]:
            fail["tries"] += 1
            raise zmq.ZMQError(errno.EMFILE)
        sock = zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 64)
        return sock

    dial = Redialer(make, f"tcp://127.0.0.1:{port}", "test client", min_backoff_s=0.2, max_backoff_s=0.4)
    try:
        dial.sock.send(b"hello")
        assert router.poll(5000)
        identity, _ = router.recv_multipart()
        fail["on"] = True
        router.send_multipart([identity, b"\x00" * 100])  # over the client's 64 bytes: its connection is given up
        assert _until(lambda: fail["tries"] >= 1 or dial.check(), timeout_s=5) and fail["tries"] >= 1
        assert dial.sock.closed and dial.reconnects == 0
        t0 = time.monotonic()
        assert dial.poll(500) is False
        assert time.monotonic() - t0 >= 0.45  # slept its timeout: no spin
        assert fail["tries"] >= 2  # retried during that wait, after the backoff
        fail["on"] = False
        assert _until(lambda: dial.check() or not dial.sock.closed, timeout_s=5)
        assert not dial.sock.closed and dial.reconnects == 1
    finally:
        dial.close()
        router.close(0)


def test_a_retired_workers_connection_that_is_still_alive_is_refused_and_its_replacement_served(zctx, ticket_server):
    """A worker retired as hung may still be alive until the launcher's kill lands (its link came back): a ticket
    granted to it meanwhile died with it, held by nobody, and the learner waited for it until its timeout (the
    two-host drill, a cable pulled past the hang timeout). Its connections are refused after the retirement; the
    replacement (new connections, same worker id) is served."""
    ctrl, server = ticket_server
    old = AdmissionClient(server.address, worker_id=1, context=zctx)
    new = None
    try:
        first = old.acquire(timeout_s=10)
        assert first is not None
        assert server.retire(1) == [first.index]  # its ticket back in the pool
        assert old.acquire(timeout_s=1.5) is None  # still alive, asking again: refused, nothing granted
        assert _until(lambda: server.rejected["retired"] >= 1, timeout_s=5), server.rejected
        assert server.held_by(1) == []
        new = AdmissionClient(server.address, worker_id=1, context=zctx)
        again = new.acquire(timeout_s=10)
        assert again is not None and again.index == first.index  # the replacement takes the returned ticket
        assert server.held_by(1) == [again.index]
    finally:
        old.close()
        if new is not None:
            new.close()
