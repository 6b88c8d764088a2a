"""Hostile messages a review found getting past the door, each refused now and counted, with nothing stopped:
a group id that crashed the learner's intake, a request number that killed the admission server, an environment
segment whose end wrapped around int64 and sized gigabytes of arrays, a group id naming another worker's draw
(which left that worker's ticket stuck), a msgpack header of nested empty arrays, and an evaluation report of a
point the learner never reached. Real sockets (loopback) where a socket is what was attacked."""

from __future__ import annotations

import struct
import time

import msgpack
import numpy as np
import pytest
import zmq

from asyncppo.staleness import AdmissionClient, AdmissionController, AdmissionServer
from asyncppo.stream.errors import WireError
from asyncppo.stream.framing import MAX_HEADER_BYTES, MESSAGE_SCHEMA, decode_message, read_header
from asyncppo.stream.group_ids import group_key, parse_key
from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.turns import TurnColumns, check_turns
from asyncppo.stream.validate import ContentLimits, GroupValidator
from asyncppo.stream.wire import MAGIC, decode_group, encode_group

LIMITS = ContentLimits(vocab_size=16, max_prompt_len=6, max_response_len=5, max_samples=2, num_workers=2,
                       logprob_tolerance=0.01)


def _group(gid: str, worker: int = 0, ticket: int = 0) -> TrajectoryGroup:
    samples = [Sample(np.array([4, 5], np.int32), np.array([-0.5, -0.1], np.float32), 1.0, "stop", 0, 0)]
    return decode_group(encode_group(TrajectoryGroup(gid, worker, np.array([1, 2], np.int32), samples,
                                                     ticket=ticket)))


def test_group_ids_must_be_the_senders_own_draws():
    assert parse_key(group_key(3, 0, 17)) == (3, 17) and parse_key(group_key(3, 2, 17)) == (3, 17)
    for bad in ("0-\u00b2", "0-" + "1" * 5000, "\u0661-1", "0-1-", "-1", "0.1.2-3", "x", 7):
        assert parse_key(bad) is None, bad  # never raises, whatever the peer sent
    v = GroupValidator(LIMITS, lambda: 0)
    for gid in ("0-\u00b2", "0-" + "1" * 5000, "evil"):
        err = v.check(_group(gid))
        assert err is not None and err.reason == "group_id"
    # worker 1 naming worker 0's next draw is refused, so worker 0's own group still gets in
    err = v.check(_group("0-0", worker=1))
    assert err is not None and err.reason == "group_id"
    assert v.check(_group("0-0", worker=0)) is None
    assert v.rejected["group_id"] == 4 and v.accepted == 1


def test_a_segment_whose_end_wraps_around_is_refused_without_allocating():
    length = 1 << 33  # 8 G positions: sizing arrays by it would take the learner's memory
    runs = np.array([[(1 << 63) - length, length]], dtype=np.int64)
    turns = TurnColumns(env_runs=runs, run_offsets=[0, 1], turn_rewards=np.zeros(0), reward_offsets=[0, 0])
    t0 = time.perf_counter()
    problem = check_turns(turns, [4])
    assert problem is not None and "past the response of 4 tokens" in problem
    assert time.perf_counter() - t0 < 1.0


def test_a_header_of_nested_empty_arrays_is_refused_before_it_is_unpacked():
    n = MAX_HEADER_BYTES + 1
    header = b"\xdd" + struct.pack(">I", n) + b"\x90" * n  # array32 of n empty arrays, one byte each
    frame = MAGIC + struct.pack("<I", len(header)) + header
    with pytest.raises(WireError) as e:
        read_header(memoryview(frame), MAGIC, None)
    assert e.value.reason == "oversized"
    small = msgpack.packb([[]] * 5000)  # within the byte limit, but an array longer than any header has
    with pytest.raises(WireError) as e:
        read_header(memoryview(MAGIC + struct.pack("<I", len(small)) + small), MAGIC, None)
    assert e.value.reason == "malformed"


def test_a_long_reference_answer_is_cut_so_its_group_is_never_refused_unread():
    from types import SimpleNamespace

    from asyncppo.rollout.engine import Completion, FinishedGroup
    from asyncppo.rollout.groups import ANSWER_CHARS, GroupBuilder, InFlight
    from asyncppo.rollout.meter import EngineMeter

    from asyncppo.data.chat_tokenizer import build_chat_tokenizer

    done = FinishedGroup("0-0", [Completion(token_ids=np.array([4, 5]), logprobs=np.array([-0.5, -0.1]),
                                            finish_reason="stop")])
    row = SimpleNamespace(prompt_ids=[1, 2], answer="tests " * 400_000, index=0)  # 2.4 MB of unit tests
    flight = InFlight(row=row, ticket=SimpleNamespace(index=0), admitted_at=time.time(), version=0)
    stats = {"reward_failures": 0, "gen_tokens": 0, "samples": 0}
    decoder = SimpleNamespace(decode=build_chat_tokenizer().decode)  # what the builder reads of an engine
    group = GroupBuilder(decoder, lambda text, answer: 1.0, 0, stats).build(done, flight, EngineMeter())
    assert len(group.answer) == ANSWER_CHARS
    assert decode_group(encode_group(group)).answer == group.answer  # within the header limit
    group.answer = row.answer  # whole, the sender refuses it itself rather than the learner unread
    with pytest.raises(WireError) as e:
        encode_group(group)
    assert e.value.reason == "schema" and "header" in str(e.value)


def test_an_int_field_past_2_53_is_refused():
    spec = {"acquire": {"worker_id": int, "req": int, "count": int}}
    ok = msgpack.packb({"schema": MESSAGE_SCHEMA, "kind": "acquire", "worker_id": 0, "req": 1 << 53, "count": 1})
    assert decode_message(ok, spec)[1]["req"] == 1 << 53
    bad = msgpack.packb({"schema": MESSAGE_SCHEMA, "kind": "acquire", "worker_id": 0, "req": (1 << 64) - 1,
                         "count": 2})
    with pytest.raises(WireError) as e:
        decode_message(bad, spec)
    assert e.value.reason == "schema"


def test_the_admission_server_survives_a_request_number_no_reply_could_carry():
    ctx = zmq.Context()
    ctrl = AdmissionController(batch_groups=2, max_staleness=1)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0", context=ctx)
    evil = ctx.socket(zmq.DEALER)
    evil.connect(server.address)
    honest = AdmissionClient(server.address, 0, context=ctx)
    try:
        evil.send(msgpack.packb({"schema": MESSAGE_SCHEMA, "kind": "acquire", "worker_id": 0,
                                 "req": (1 << 64) - 1, "count": 2}))
        deadline = time.monotonic() + 5
        while not server.rejected.get("schema") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.rejected["schema"] == 1 and ctrl.stats()["live"] == 0  # refused, nothing granted
        # a request that passes its checks and still breaks its handler (a bug): refused and counted, the thread
        # lives on (before, one raise ended the server thread and no ticket was ever granted again)
        park, calls = server._park, []
        server._park = lambda *a: calls.append(a) or (_ for _ in ()).throw(RuntimeError("a handler bug"))
        evil.send(msgpack.packb({"schema": MESSAGE_SCHEMA, "kind": "acquire", "worker_id": 0, "req": 7,
                                 "count": 1}))
        deadline = time.monotonic() + 5
        while not server.rejected.get("malformed") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls and server.rejected["malformed"] == 1
        server._park = park
        ticket = honest.acquire(timeout_s=5)
        assert ticket is not None and ticket.index == 0  # the server thread lives on
    finally:
        honest.close()
        evil.close(0)
        server.close()
        ctx.term()


def test_an_evaluation_report_past_the_learners_version_or_of_a_logged_point_is_refused():
    from asyncppo.learner.evaluation import EngineEvaluation
    from asyncppo.stream.evals import EvalReport, EvalSender, FileScores

    class Log:
        def __init__(self):
            self.records = []

        def log(self, step, metrics):
            self.records.append((step, metrics))

    ev = EngineEvaluation("tcp://127.0.0.1:0", num_workers=1)
    sender = EvalSender(ev.address)
    logger = Log()
    try:
        def report(point, vmax):
            scores = FileScores(prompts=1, greedy_reward=1.0, sampled=1, sampled_reward=0.0, tokens=4, answers=2)
            assert sender.send(EvalReport(point=point, worker_id=0, version_min=vmax, version_max=vmax,
                                          files={"task.jsonl": scores}), timeout_s=5)

        report(1 << 40, 0)  # a point the run never reaches
        report(3, 9)  # weights newer than the learner's
        report(2, 2)  # a real one
        deadline = time.monotonic() + 5
        while ev.receiver.rejected + len(logger.records) < 3 and time.monotonic() < deadline:
            ev.poll(logger, timeout_s=0.1, version=4)
        assert [step for step, _ in logger.records] == [2] and ev.receiver.rejected == 2
        report(2, 2)  # the logged point again
        deadline = time.monotonic() + 5
        while ev.receiver.rejected < 3 and time.monotonic() < deadline:
            ev.poll(logger, timeout_s=0.1, version=4)
        assert ev.receiver.rejected == 3 and len(logger.records) == 1 and ev.aggregator.pending() == []
    finally:
        sender.close()
        ev.close()
