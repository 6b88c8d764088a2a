"""A worker's clients survive one bad message from the server (issue #52, item 6): what a flaky link or a
half-written frame produces across hosts. Each test plays a hostile server with a raw ZeroMQ socket on loopback.

Before: one control frame over 64 KiB, or one admission reply over 4 KiB, made libzmq drop the connection for good
(a protocol error: libzmq never reconnects those), so the worker read its old control state for the rest of the
run, and its next ticket request reached nobody; ``AdmissionClient.close()`` stopped at a malformed reply and never
gave back the grant queued behind it; and the learner logged (or, with several workers, held open until the end)
evaluation rounds of points the schedule never evaluates."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Optional

import msgpack
import pytest
import zmq

from asyncppo.staleness import AdmissionClient
from asyncppo.staleness.tickets import MAXMSGSIZE, REQUEST_SPEC
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
    # the waiting acquire asks again on a new connection: it reaches the server, and its grant is taken
    identity2, kind, f = server.next_request()
    assert (kind, f["req"], f["count"]) == ("acquire", 1, 1) and identity2 != identity
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
    assert (kind, f["req"], f["count"]) == ("acquire", 2, 2)  # the two still open, on the new connection
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
