"""Hostile input against the learner's live receiving end: real ZeroMQ sockets, the admission server, the content
validator, the feeder and the ticket-ordered staleness buffer, wired as the learner wires them.

An honest worker generates groups for its tickets; an attacker interleaves more than a thousand malformed
messages of every kind (wire-level garbage, well-formed groups with bad content, forged and replayed tickets,
admission-channel abuse) with them. Every valid group must arrive intact and in ticket order, no bad one may be
admitted, every bad one must be counted exactly once, and the learner's intake must survive.
"""

import struct
import threading
import time

import msgpack
import numpy as np
import zmq

from asyncppo.staleness import AdmissionClient, AdmissionController, AdmissionServer, Feeder, StalenessBuffer
from asyncppo.stream.channels import TrajectoryReceiver, TrajectorySender
from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.validate import ContentLimits, GroupValidator, RejectionSummary
from asyncppo.stream.wire import encode_group, encode_message

B, K, STEPS = 4, 1, 12
VOCAB, MAX_PROMPT, MAX_RESP, N = 32, 8, 6, 2
LIMIT = 64 * 1024
LIMITS = ContentLimits(vocab_size=VOCAB, max_prompt_len=MAX_PROMPT, max_response_len=MAX_RESP, max_samples=N,
                       num_workers=2)


def make_group(gid, worker, ticket, version, rng, prompt_len=None, **over):
    p = int(rng.integers(1, MAX_PROMPT + 1)) if prompt_len is None else prompt_len
    samples = []
    for _ in range(N):
        T = int(rng.integers(1, MAX_RESP + 1))
        samples.append(Sample(rng.integers(0, VOCAB, T).astype(np.int32),
                              -rng.random(T).astype(np.float32) * 3, float(rng.normal()), "stop", version, version))
    g = TrajectoryGroup(gid, worker, rng.integers(0, VOCAB, p).astype(np.int32), samples, ticket=ticket,
                        timings={"gen_s": 0.01})
    for key, fn in over.items():
        fn(g)
    return g


def as_episode(lp_env=0.0, reward=1.5):
    """Make sample 0 a 2-turn episode: model, model, environment, environment, model (asyncppo.stream.turns)."""
    def f(g):
        s = g.samples[0]
        s.response_ids = np.arange(1, 6, dtype=np.int32)
        s.behavior_logprobs = np.array([-1.0, -0.5, lp_env, 0.0, -0.25], np.float32)
        s.env_runs, s.turn_rewards, s.reward = np.array([[2, 2]]), np.array([0.5, 1.0]), reward
    return f


def _hdr(frame):
    hlen = struct.unpack_from("<4sI", frame)[1]
    return hlen, msgpack.unpackb(frame[8:8 + hlen])


def _with_header(frame, **fields):
    """Re-encode the msgpack header with some fields changed (same length where possible)."""
    hlen, hdr = _hdr(frame)
    names = ["schema", "kind", "group_id", "worker_id", "prompt_index", "ticket", "answer", "timings", "n",
             "prompt_dtype", "prompt_len", "response_dtype", "logprob_dtype"]
    for k, v in fields.items():
        hdr[names.index(k)] = v
    h2 = msgpack.packb(hdr, use_bin_type=True)
    return frame[:4] + struct.pack("<I", len(h2)) + h2 + frame[8 + hlen:]


def _table_start(frame):
    hlen, _ = _hdr(frame)
    end = 8 + hlen
    return end + (-end) % 8


def wire_attacks(valid: bytes, rng, fresh):
    """Malformed frames (each refused by the decoder). ``fresh(**kw)`` encodes a new well-formed group."""
    out = []
    out.append(rng.bytes(int(rng.integers(1, 200))))  # random junk
    out.append(b"")
    out.append(valid[: int(rng.integers(1, len(valid)))])  # truncated
    out.append(valid + b"\0")  # one byte too many
    out.append(b"XXXX" + valid[4:])  # bad magic
    out.append(rng.bytes(LIMIT + int(rng.integers(1, LIMIT))))  # oversized (below the disconnect guard)
    out.append(_with_header(valid, schema=2))  # another wire version
    out.append(_with_header(valid, worker_id="0"))  # wrong type
    out.append(_with_header(valid, n=N + 1))  # table does not match the frame
    # prompt of 4 int32 tokens declared as 3: the frame length still adds up, the padding is not zero
    def last_prompt_token_nonzero(g):  # a zero there would be valid padding: the shorter prompt is then the truth
        g.prompt_ids[3] = 1 + g.prompt_ids[3] % (VOCAB - 1)

    out.append(_with_header(fresh(prompt_len=4, z=last_prompt_token_nonzero), prompt_len=3))
    # version_min > version_max of sample 0 (table: n x u32 len, n x f64 reward, n x i64 vmin, ...)
    t = _table_start(valid)
    b = bytearray(valid)
    struct.pack_into("<q", b, t + 12 * N, 10**6)  # above every real version, so always above version_max
    out.append(bytes(b))
    b = bytearray(valid)
    b[t + 28 * N] = 7  # flags: undefined bits
    out.append(bytes(b))
    # a multi-turn group whose environment segment moved to the first response token: an opening segment ends no
    # model turn, so its two turn rewards no longer match its one model turn
    b = bytearray(fresh(e=as_episode()))
    struct.pack_into("<q", b, len(b) - 16 - 16, 0)  # the one (start, length) row, before 2 float64 turn rewards
    out.append(bytes(b))
    return out, ("multipart",)


def content_attacks(fresh, ticket_of_other, version_now):
    """Well-formed groups whose content the learner must refuse: (frame, expected reason)."""
    def set_reward(v):
        def f(g):
            g.samples[0].reward = v
        return f

    def set_lp(v):
        def f(g):
            g.samples[0].behavior_logprobs[0] = v
        return f

    def set_id(v):
        def f(g):
            g.samples[1].response_ids[0] = v
        return f

    def long_response(g):
        g.samples[0].response_ids = np.zeros(MAX_RESP + 1, np.int32)
        g.samples[0].behavior_logprobs = np.full(MAX_RESP + 1, -1.0, np.float32)

    def third_sample(g):
        g.samples = g.samples + [g.samples[0]]

    def future(g):
        for s in g.samples:
            s.version_min = s.version_max = version_now + 1000

    return [
        (fresh(r=set_reward(float("nan"))), "nonfinite"),
        (fresh(r=set_reward(float("-inf"))), "nonfinite"),
        (fresh(lp=set_lp(float("nan"))), "nonfinite"),
        (fresh(lp=set_lp(0.5)), "logprob"),
        (fresh(i=set_id(VOCAB)), "token_id"),
        (fresh(i=set_id(-3)), "token_id"),
        (fresh(prompt_len=MAX_PROMPT + 1), "length"),
        (fresh(l=long_response), "length"),
        (fresh(s=third_sample), "length"),
        (fresh(v=future), "version"),
        (fresh(ticket=-1), "ticket"),
        (fresh(ticket=10**9), "ticket"),
        (fresh(ticket=ticket_of_other, worker=1), "worker"),
        (fresh(t=lambda g: g.timings.update(gen_s=float("inf"))), "nonfinite"),
        (fresh(e=as_episode(lp_env=-0.75)), "turns"),  # an environment token with a behaviour log-prob
        (fresh(e=as_episode(reward=3.0)), "turns"),  # a reward that is not the sum of the turn rewards
    ]


def test_a_thousand_malformed_messages_do_not_reach_a_batch_and_every_valid_group_arrives():
    ctx = zmq.Context()
    ctrl = AdmissionController(B, K)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=ctx, max_tickets_per_peer=4, max_pending=32)
    rx = TrajectoryReceiver("tcp://127.0.0.1:0", hwm=5000, max_message_bytes=LIMIT, context=ctx)
    version = [0]
    validator = GroupValidator(LIMITS, lambda: version[0], ledger=server)
    buf = StalenessBuffer(K, capacity_groups=64, on_drop=lambda g: ctrl.release(g.ticket),
                          on_take=lambda g: ctrl.consumed(g.ticket), order=ctrl)
    summary = RejectionSummary({"stream": lambda: rx.rejected, "content": lambda: validator.rejected,
                                "admission": lambda: server.rejected}, interval_s=0.5)
    feeder = Feeder(rx, buf, poll_ms=10, validator=validator, summary=summary)

    honest_tx = TrajectorySender(rx.address, hwm=100, context=ctx)
    evil_tx = TrajectorySender(rx.address, hwm=5000, context=ctx)
    evil_adm = ctx.socket(zmq.DEALER)
    evil_adm.connect(server.address)
    sent: dict[str, TrajectoryGroup] = {}
    counts = {"wire": 0, "content": 0, "not_holder": 0, "adm_garbage": 0}
    expected_content: dict[str, int] = {}
    failures: list = []

    def refused():
        return rx.num_rejected + validator.num_rejected

    def wait_for(pred, what, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: received {rx.received}, refused {rx.rejected} "
                                     f"{validator.rejected}, accepted {validator.accepted}, last {validator.last_error}")
            time.sleep(0.001)

    def honest():
        rng = np.random.default_rng(0)
        client = AdmissionClient(server.address, worker_id=0, context=ctx)
        evil_client = AdmissionClient(server.address, worker_id=1, context=ctx)
        try:
            for j in range(STEPS * B):
                t = client.acquire(timeout_s=30)
                assert t is not None
                wait_for(lambda: version[0] >= t.min_version, "the learner to reach the ticket's min_version")
                gid = f"0-{j}"
                g = make_group(gid, 0, t.index, t.min_version, rng, **({"e": as_episode()} if j % 4 == 1 else {}))
                frame = encode_group(g)

                # Content attacks carry no one's ticket: on an unauthenticated stream a peer that names a held ticket
                # and its holder's worker id is indistinguishable from that worker (docs/security.md; CURVE closes it)
                def fresh(prompt_len=None, ticket=-1, worker=0, **over):
                    k = len(sent) * 1000 + counts["wire"] + counts["content"]
                    return encode_group(make_group(f"{worker}-{10**6 + k}", worker, ticket, t.min_version, rng, prompt_len,
                                                   **over))

                # --- a burst before the valid group: all must be refused (and counted) before it is sent
                before = refused()
                frames, _ = wire_attacks(frame, rng, fresh)
                for f in frames:
                    evil_tx.send_encoded(f)
                evil_tx._sock.send_multipart([frame, frame])  # a group is one frame
                counts["wire"] += len(frames) + 1
                for f, reason in content_attacks(fresh, t.index, version[0]):
                    evil_tx.send_encoded(f)
                    expected_content[reason] = expected_content.get(reason, 0) + 1
                    counts["content"] += 1
                # the admission channel: someone else's ticket, and garbage
                evil_adm.send(encode_message("release", worker_id=0, index=t.index))
                evil_adm.send(b"\x93garbage")
                evil_adm.send_multipart([b"a", b"b"])
                counts["not_holder"] += 1
                counts["adm_garbage"] += 2
                n_burst = len(frames) + 1 + len(content_attacks(fresh, t.index, version[0]))
                wait_for(lambda: refused() >= before + n_burst, "the burst to be refused")
                assert validator.accepted == len(sent), "an attack was admitted"
                # --- the valid group, then replays of it once it is in
                sent[gid] = g
                assert honest_tx.send_encoded(frame, timeout_s=30)
                wait_for(lambda: validator.accepted >= len(sent), "the valid group to be accepted")
                before = refused()
                evil_tx.send_encoded(frame)  # exact replay
                # same ticket, a new id of worker 0 (its draw zero-padded by 8 digits: the header grows by 8 bytes and the
                # array regions stay 8-aligned)
                evil_tx.send_encoded(_with_header(frame, group_id="0-" + str(j).zfill(len(str(j)) + 8)))
                expected_content["duplicate"] = expected_content.get("duplicate", 0) + 1
                expected_content["ticket"] = expected_content.get("ticket", 0) + 1
                counts["content"] += 2
                wait_for(lambda: refused() >= before + 2, "the replays to be refused")
                if j % 8 == 7:
                    # the attacker's own ticket with bad content: refused, and the slot comes back to the pool
                    et = evil_client.acquire(timeout_s=30)
                    assert et is not None
                    bad = make_group(f"1-{j}", 1, et.index, et.min_version, rng,
                                     r=lambda g: setattr(g.samples[0], "reward", float("nan")))
                    before = refused()
                    evil_tx.send(bad)
                    expected_content["nonfinite"] = expected_content.get("nonfinite", 0) + 1
                    counts["content"] += 1
                    wait_for(lambda: refused() >= before + 1, "the attacker's group to be refused")
                    assert not ctrl.is_outstanding(et.index)
        except BaseException as e:  # surfaced by the main thread
            failures.append(e)
        finally:
            client.close()
            evil_client.close()

    th = threading.Thread(target=honest, daemon=True)
    th.start()
    trained = []
    for v in range(STEPS):
        batch = buf.take(B, learner_version=v, timeout_s=60)
        assert not failures, failures
        assert len(batch) == B, (v, buf.missing(B), ctrl.stats())
        trained += batch
        version[0] = v + 1
        ctrl.set_version(v + 1)
    th.join(60)
    assert not th.is_alive() and not failures, failures
    # the admission channel was hammered too: a request flood stays bounded and is counted
    for req in range(1, 201):
        evil_adm.send(encode_message("acquire", worker_id=1, req=req, count=1))
    wait_for(lambda: server.rejected["pending_full"] > 0, "the flood to be refused")
    assert server.num_pending <= 32
    for req in range(1, 201):
        evil_adm.send(encode_message("cancel", worker_id=1, req=req))
    evil_adm.send(b"x" * (1 << 20))  # over ZMQ_MAXMSGSIZE: libzmq drops the connection before reading it all
    wait_for(lambda: server.rejected["not_holder"] >= counts["not_holder"], "releases to be refused")
    summary.poll(force=True)

    # every valid group, intact, in ticket order
    assert [g.ticket for g in trained] == sorted(g.ticket for g in trained)
    assert [g.group_id for g in trained] == [f"0-{j}" for j in range(STEPS * B)]
    for g in trained:
        ref = sent[g.group_id]
        assert np.array_equal(g.prompt_ids, ref.prompt_ids)
        for s, r in zip(g.samples, ref.samples):
            assert np.array_equal(s.response_ids, r.response_ids)
            assert np.array_equal(s.behavior_logprobs, r.behavior_logprobs)
            assert s.reward == r.reward and s.version_min == r.version_min
            assert np.array_equal(s.env_runs, r.env_runs) and np.array_equal(s.turn_rewards, r.turn_rewards)
    # nothing bad was admitted, every bad message counted exactly once, by the reason it was sent for
    total_bad = counts["wire"] + counts["content"]
    assert total_bad >= 1000, total_bad
    assert validator.accepted == STEPS * B == buf.put_count
    assert rx.num_rejected == counts["wire"], rx.rejected
    assert validator.num_rejected == counts["content"], validator.rejected
    for reason, n in expected_content.items():
        assert validator.rejected[reason] == n, (reason, validator.rejected)
    assert rx.rejected["oversized"] == STEPS * B and rx.rejected["version"] == STEPS * B
    assert server.rejected["not_holder"] == counts["not_holder"]
    assert server.rejected["malformed"] + server.rejected["schema"] == counts["adm_garbage"]
    assert validator.forfeited == STEPS * B // 8  # the attacker's own tickets came back, nobody else's
    assert buf.stats()["dropped_stale"] == 0 and buf.stats()["lag_max"] <= K
    # ... and the intake is still alive and serving
    assert feeder.alive and feeder.error is None
    assert summary.lines >= 1

    feeder.close()
    for x in (honest_tx, evil_tx):
        x.close(linger_ms=0)
    evil_adm.close(linger=0)
    server.close()
    rx.close()
    ctx.destroy(linger=0)


def test_a_stale_group_with_a_ticket_that_is_not_outstanding_does_not_end_the_run():
    """The reported crash: arrival-order buffer, a forged group with ticket -1 (or a consumed one) and an old
    version. The lag guard drops it, the drop hook releases the ticket, and that used to raise."""
    ctrl = AdmissionController(batch_groups=1, max_staleness=0)
    ctrl.set_version(5)
    buf = StalenessBuffer(0, capacity_groups=4, on_drop=lambda g: ctrl.release(g.ticket))
    rng = np.random.default_rng(1)
    for ticket in (-1, 3):  # never granted / not outstanding
        buf.put(make_group(f"x{ticket}", 0, ticket, 0, rng))
    good = make_group("ok", 0, -1, 5, rng)
    buf.put(good)
    assert buf.take(1, learner_version=5, timeout_s=1) == [good]  # the stale ones dropped on the way
    assert buf.stats()["dropped_stale"] == 2
    assert ctrl.stats()["release_unknown"] == 2 and ctrl.stats()["live"] == 0
