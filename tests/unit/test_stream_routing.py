"""The routing column of a group (stream/routing.py): through the wire bit for bit, and refused at the door when it
does not fit the model the learner trains."""

import struct

import msgpack
import numpy as np
import pytest

from asyncppo.stream.errors import WireError
from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.routing import NONE_U8, NONE_U16, RoutingColumn, content_problem
from asyncppo.stream.validate import ContentError, ContentLimits, check_content
from asyncppo.stream.wire import decode_group, encode_group

PROMPT = np.array([1, 2, 3], np.int32)
LENGTHS = (2, 4)
LAYERS, TOP_K, EXPERTS = 2, 2, 8


def _rows(seed=0, experts=EXPERTS):
    """Per sample ``[P + T, layers, top_k]``: two distinct experts a row, the last position without a record."""
    rng = np.random.default_rng(seed)
    out = []
    for t in LENGTHS:
        rows = np.stack([np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(LAYERS)])
                         for _ in range(len(PROMPT) + t)]).astype(np.int64)
        rows[-1] = -1
        out.append(rows)
    return out


def _group(routing=None, turns=False):
    samples = [Sample(np.arange(4, 4 + t, dtype=np.int32), np.full(t, -0.5, np.float32), 1.0, "stop", 0, 0)
               for t in LENGTHS]
    if turns:
        samples[1].env_runs = np.array([[1, 2]], np.int64)
        samples[1].turn_rewards = np.array([0.5, 0.5])
        samples[1].behavior_logprobs[1:3] = 0.0
    return TrajectoryGroup("0-0", 0, PROMPT, samples, ticket=0, routing=routing)


@pytest.mark.parametrize("experts", [8, 300])
@pytest.mark.parametrize("turns", [False, True])
def test_round_trip_bit_for_bit_with_and_without_turns(experts, turns):
    col = RoutingColumn.from_samples(_rows(experts=experts), experts)
    assert col.experts.dtype == (np.uint8 if experts < 255 else np.uint16)
    back = decode_group(encode_group(_group(col, turns)))
    assert np.array_equal(back.routing.experts, col.experts)
    for got, want in zip(back.routing.per_sample(len(PROMPT), list(LENGTHS)), _rows(experts=experts)):
        assert np.array_equal(got, want)  # -1 again where there was no record
    assert (back.turn_columns() is not None) == turns
    assert back.sample_lengths() == list(LENGTHS)
    plain = encode_group(_group(None, turns))
    # the column's bytes and its short header field (padded to 8), nothing else
    assert 0 < len(encode_group(_group(col, turns))) - len(plain) - col.experts.nbytes <= 8
    assert decode_group(plain).routing is None


def test_the_sender_names_a_column_that_does_not_fit():
    short = RoutingColumn(RoutingColumn.from_samples(_rows(), EXPERTS).experts[:-1])
    with pytest.raises(WireError, match="rows for a group of"):
        encode_group(_group(short))
    with pytest.raises(WireError, match="uint8/uint16"):
        encode_group(_group(RoutingColumn(np.zeros((15, 2, 2), np.int32))))


def _header_and_rest(frame):
    n = struct.unpack_from("<I", frame, 4)[0]
    return msgpack.unpackb(frame[8 : 8 + n]), n


def _with_header(frame, header):
    old, n = _header_and_rest(frame)
    body = msgpack.packb(header)
    start = 8 + n + (-(8 + n) % 8)
    new = b"APPO" + struct.pack("<I", len(body)) + body
    return new + b"\0" * (-len(new) % 8) + frame[start:]


@pytest.mark.parametrize("field", [[2, 2, "<u4"], [2, 2], [0, 2, "|u1"], [2, 99, "|u1"], [2, "2", "|u1"]])
def test_a_bad_routing_field_is_a_schema_error(field):
    frame = encode_group(_group(RoutingColumn.from_samples(_rows(), EXPERTS)))
    header, _ = _header_and_rest(frame)
    header[-1] = field
    with pytest.raises(WireError) as e:
        decode_group(_with_header(frame, header))
    assert e.value.reason == "schema"


def test_a_frame_cut_short_or_declaring_more_rows_is_malformed():
    frame = encode_group(_group(RoutingColumn.from_samples(_rows(), EXPERTS)))
    with pytest.raises(WireError) as e:
        decode_group(frame[:-4])
    assert e.value.reason == "malformed"
    header, _ = _header_and_rest(frame)
    header[-1] = [LAYERS, TOP_K * 4, "|u1"]  # four times the bytes the frame holds
    with pytest.raises(WireError) as e:
        decode_group(_with_header(frame, header))
    assert e.value.reason == "malformed"


LIMITS = ContentLimits(vocab_size=16, max_prompt_len=6, max_response_len=5, max_samples=2,
                       routing=(LAYERS, TOP_K, EXPERTS))


def _refused(group, limits=LIMITS):
    with pytest.raises(ContentError) as e:
        check_content(decode_group(encode_group(group)), limits, learner_version=0)
    assert e.value.reason == "routing"
    return str(e.value)


def test_the_door_refuses_routing_that_does_not_fit_the_model():
    good = RoutingColumn.from_samples(_rows(), EXPERTS)
    check_content(decode_group(encode_group(_group(good))), LIMITS, learner_version=0)  # accepted
    bad = good.experts.copy()
    bad[4, 1, 0] = EXPERTS  # one id past the model's experts
    assert "expert id 8" in _refused(_group(RoutingColumn(bad)))
    twice = good.experts.copy()
    twice[2, 0] = [3, 3]
    assert "same expert twice" in _refused(_group(RoutingColumn(twice)))
    other = RoutingColumn.from_samples([r[:, :1] for r in _rows()], EXPERTS)  # a model of 1 layer
    assert "1 layers" in _refused(_group(other))
    assert "no routing column" in _refused(_group(None))
    plain = ContentLimits(vocab_size=16, max_prompt_len=6, max_response_len=5, max_samples=2)
    assert "without routing replay" in _refused(_group(good), plain)


def test_no_record_marks_are_not_expert_ids():
    rows = _rows()
    rows[0][:] = -1  # a whole sample without records: allowed (the learner routes those positions itself)
    col = RoutingColumn.from_samples(rows, EXPERTS)
    assert (col.experts[: len(PROMPT) + LENGTHS[0]] == NONE_U8).all()
    assert content_problem(col, (LAYERS, TOP_K, EXPERTS), len(PROMPT), list(LENGTHS)) is None
    assert RoutingColumn.from_samples(rows, 1000).none_value == NONE_U16


def test_a_refused_routing_column_is_counted_and_its_ticket_goes_back():
    from asyncppo.staleness import AdmissionController
    from asyncppo.stream.validate import GroupValidator
    from tests.unit.test_stream_validate import Ledger

    ctrl = AdmissionController(batch_groups=4, max_staleness=0)
    ledger = Ledger(ctrl)
    t0, t1 = ledger.grant(0), ledger.grant(0)
    v = GroupValidator(LIMITS, lambda: 0, ledger=ledger)
    bad = RoutingColumn.from_samples(_rows(), EXPERTS).experts.copy()
    bad[0, 0, 0] = 200  # an expert the model does not have
    group = _group(RoutingColumn(bad))
    group.ticket = t0.index
    assert v.check(decode_group(encode_group(group))).reason == "routing"
    assert v.forfeited == 1 and not ctrl.is_outstanding(t0.index)  # back to the pool, to be generated again
    good = _group(RoutingColumn.from_samples(_rows(), EXPERTS))
    good.group_id, good.ticket = "0-1", t1.index
    assert v.check(decode_group(encode_group(good))) is None
    assert v.rejected["routing"] == 1 and v.accepted == 1
