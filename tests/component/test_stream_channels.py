"""Trajectory and control channels over real loopback sockets."""

import time

import pytest
import zmq

from asyncppo.stream.channels import ControlPublisher, ControlSubscriber, TrajectoryReceiver, TrajectorySender
from asyncppo.stream.endpoints import bind_endpoint, connect_endpoint
from asyncppo.stream.wire import encode_group, encode_message
from test_stream_wire import _rebuild, assert_same, make_group


def test_round_trip_through_push_pull(ctx):
    rx = TrajectoryReceiver(bind_endpoint("127.0.0.1", 0), hwm=8, context=ctx)
    assert rx.address.startswith("tcp://127.0.0.1:") and not rx.address.endswith(":0")
    tx = TrajectorySender(rx.address, hwm=8, context=ctx)
    groups = [make_group(seed=i, T=2048 - 100 * i) for i in range(12)]
    for g in groups:
        assert tx.send(g, timeout_s=5)
    got = [rx.recv(timeout_ms=5000) for _ in groups]
    for g, h in zip(groups, got):
        assert_same(g, h)
    assert rx.recv(timeout_ms=50) is None
    assert rx.received == 12 and rx.num_rejected == 0
    tx.close()
    rx.close()


def test_bad_messages_are_counted_and_good_ones_keep_flowing(ctx):
    limit = 300_000
    rx = TrajectoryReceiver("tcp://127.0.0.1:0", max_message_bytes=limit, context=ctx)
    raw = ctx.socket(zmq.PUSH)  # one socket, so the receiver sees our exact order
    raw.setsockopt(zmq.LINGER, 1000)
    raw.connect(rx.address)
    good = [make_group(seed=i, T=256) for i in range(6)]
    enc = [encode_group(g) for g in good]
    header_bad = bytearray(enc[0])
    header_bad[20:30] = b"\xc1" * 10  # corrupt msgpack inside the header
    wrong_version = _rebuild(good[0], lambda h: h.__setitem__(0, 7))
    wrong_type = _rebuild(good[0], lambda h: h.__setitem__(6, 42))  # valid frame, int where str (answer) is required
    oversized = encode_group(make_group(seed=9, n=8, T=limit // 40))
    assert limit < len(oversized) < 2 * limit
    sequence = [
        enc[0], b"garbage bytes", enc[1], enc[2][:-10], bytes(header_bad), enc[2], wrong_version, enc[3],
        wrong_type, oversized, enc[4], encode_message("control", x=1), enc[5],
    ]
    for m in sequence:
        raw.send(m)
    raw.send_multipart([enc[0], enc[1]])  # multipart is not a group either
    got = [rx.recv(timeout_ms=5000) for _ in good]
    for g, h in zip(good, got):
        assert_same(g, h)  # all good ones, in order
    assert rx.recv(timeout_ms=200) is None
    # garbage, truncated, corrupt header, a control message (no group magic), multipart
    assert rx.rejected == {"malformed": 5, "oversized": 1, "version": 1, "schema": 1}
    raw.close()
    rx.close()


def test_send_blocks_under_backpressure_and_times_out(ctx):
    rx = TrajectoryReceiver("tcp://127.0.0.1:0", hwm=1, context=ctx)
    tx = TrajectorySender(rx.address, hwm=1, context=ctx)
    g = make_group(T=64)
    sent = 0
    t0 = time.monotonic()
    while tx.send(g, timeout_s=0.2):  # nobody reads: the HWMs (and TCP buffers) fill, then send gives up
        sent += 1
        assert sent < 100_000
    assert time.monotonic() - t0 < 30
    for _ in range(sent):  # nothing that send() accepted is lost
        assert rx.recv(timeout_ms=5000) is not None
    assert tx.send(g, timeout_s=5)
    assert rx.recv(timeout_ms=5000) is not None
    tx.close(linger_ms=0)
    rx.close()


def test_control_latest_state_wins_and_stop_reaches_late_joiner(ctx):
    pub = ControlPublisher("tcp://127.0.0.1:0", republish_interval_s=0.05, context=ctx)
    sub = ControlSubscriber(pub.address, context=ctx)
    assert sub.latest() is None
    pub.publish(0, 0)
    s = sub.wait_for(lambda s: True, timeout_s=5)  # slow joiner: a repeat arrives even if the first was lost
    assert s is not None and s.version == 0
    for v in range(1, 30):
        pub.publish(v, v - 1)
    s = sub.wait_for(lambda s: s.version == 29, timeout_s=5)
    assert (s.version, s.weights_version, s.stop) == (29, 28, False)
    assert sub.latest().version == 29  # draining further never goes back
    # a subscriber that connects after everything was published still learns the final state, stop included
    pub.publish(30, 30, stop=True)
    late = ControlSubscriber(pub.address, context=ctx)
    s = late.latest(timeout_ms=5000)
    assert s is not None and (s.version, s.weights_version, s.stop) == (30, 30, True)
    assert sub.wait_for(lambda s: s.stop, timeout_s=5).version == 30
    assert sub.wait_for(lambda s: s.version > 30, timeout_s=0.2) is None
    with pytest.raises(TypeError):
        pub.publish(1.0, 1)
    for x in (sub, late, pub):
        x.close()


def test_control_subscriber_rejects_garbage(ctx):
    bad_pub = ctx.socket(zmq.PUB)
    bad_pub.setsockopt(zmq.LINGER, 0)
    port = bad_pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ControlSubscriber(f"tcp://127.0.0.1:{port}", context=ctx)
    deadline = time.monotonic() + 5
    good = encode_message("control", version=4, weights_version=4, stop=False, seq=1, time=0.0)
    while sub.latest() is None and time.monotonic() < deadline:
        for m in (b"\xc1junk", encode_message("control", version="4"), good):
            bad_pub.send(m)
        time.sleep(0.02)
    assert sub.latest().version == 4
    assert sub.rejected["malformed"] >= 1 and sub.rejected["schema"] >= 1
    sub.close()
    bad_pub.close()


def test_endpoints():
    assert bind_endpoint("127.0.0.1", 0) == "tcp://127.0.0.1:*"
    assert bind_endpoint("::1", 5555) == "tcp://[::1]:5555"
    assert connect_endpoint("tcp://0.0.0.0:4242", "10.0.0.7") == "tcp://10.0.0.7:4242"
    with pytest.raises(ValueError, match="advertise"):
        connect_endpoint("tcp://0.0.0.0:4242")
    with pytest.raises(ValueError):
        bind_endpoint("127.0.0.1", 70000)
