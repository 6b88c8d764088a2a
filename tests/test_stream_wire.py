"""Wire format: exact round trip and rejection of everything that is not a well-formed group."""

import struct

import msgpack
import numpy as np
import pytest

from asyncppo.stream import wire
from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.wire import WireError, decode_group, decode_message, encode_group, encode_message


def make_group(seed=0, n=8, T=512, ids_dtype=np.int32, lp_dtype=np.float32):
    rng = np.random.default_rng(seed)
    samples = [
        Sample(
            response_ids=rng.integers(0, 2**31 - 1, T - 3 * j, dtype=ids_dtype),
            behavior_logprobs=(-rng.exponential(1.0, T - 3 * j)).astype(lp_dtype),
            reward=float(rng.standard_normal()),
            finish_reason="stop" if j % 2 else "length",
            version_min=5 + j % 2,
            version_max=6,
            reward_failed=j == 3,
        )
        for j in range(n)
    ]
    return TrajectoryGroup(
        group_id=f"3-{seed}", worker_id=3, prompt_ids=rng.integers(0, 1000, 37, dtype=np.int32), samples=samples,
        prompt_index=seed, ticket=seed + 100, answer="42", timings={"gen_s": 0.1 + seed, "created_at": 1.7e9},
    )


def assert_same(a: TrajectoryGroup, b: TrajectoryGroup):
    assert (a.group_id, a.worker_id, a.prompt_index, a.ticket, a.answer) == (
        b.group_id, b.worker_id, b.prompt_index, b.ticket, b.answer)
    assert a.timings == b.timings
    assert a.prompt_ids.dtype == b.prompt_ids.dtype and a.prompt_ids.tobytes() == b.prompt_ids.tobytes()
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples):
        assert x.response_ids.dtype == y.response_ids.dtype and x.response_ids.tobytes() == y.response_ids.tobytes()
        assert x.behavior_logprobs.dtype == y.behavior_logprobs.dtype
        assert x.behavior_logprobs.tobytes() == y.behavior_logprobs.tobytes()  # bit for bit
        assert struct.pack("<d", x.reward) == struct.pack("<d", y.reward)
        assert (x.finish_reason, x.version_min, x.version_max, x.reward_failed) == (
            y.finish_reason, y.version_min, y.version_max, y.reward_failed)


@pytest.mark.parametrize("ids_dtype,lp_dtype", [(np.int32, np.float32), (np.int64, np.float64), (np.int32, np.float16)])
def test_round_trip_is_bit_exact(ids_dtype, lp_dtype):
    g = make_group(1, ids_dtype=ids_dtype, lp_dtype=lp_dtype)
    # special float values survive too
    g.samples[0].behavior_logprobs[:3] = np.array([np.nan, -np.inf, -0.0], dtype=lp_dtype)
    g.samples[1].reward = float("nan")
    out = decode_group(encode_group(g))
    assert_same(g, out)
    assert out.version_min == 5 and out.version_max == 6


def test_empty_responses_and_noncontiguous_input():
    g = make_group(2, n=3)
    g.samples[1].response_ids = np.zeros(0, np.int32)
    g.samples[1].behavior_logprobs = np.zeros(0, np.float32)
    g.samples[2].response_ids = np.arange(20, dtype=np.int32)[::2]
    g.samples[2].behavior_logprobs = np.linspace(-1, 0, 20, dtype=np.float32)[::2]
    assert_same(g, decode_group(encode_group(g)))


def test_decoded_arrays_are_readonly_views():
    out = decode_group(encode_group(make_group()))
    with pytest.raises(ValueError):
        out.samples[0].response_ids[0] = 1


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda g: setattr(g.samples[0], "finish_reason", "abort"), "finish_reason"),
        (lambda g: setattr(g.samples[0], "response_ids", g.samples[0].response_ids[:-1]), r"len\(response_ids\)=511"),
        (lambda g: setattr(g.samples[0], "response_ids", g.samples[0].response_ids.astype(np.uint8)), "dtype"),
        (lambda g: setattr(g.samples[1], "response_ids", g.samples[1].response_ids.astype(np.int64)), "share"),
        (lambda g: setattr(g, "prompt_ids", [1, 2, 3]), "numpy array"),
        (lambda g: setattr(g, "samples", []), "at least one"),
    ],
)
def test_encode_refuses_unrepresentable_groups(mutate, msg):
    g = make_group()
    mutate(g)
    with pytest.raises(WireError, match=msg) as e:
        encode_group(g)
    assert e.value.reason == "schema"


def _rebuild(g, edit):
    """Encode, then rewrite the msgpack header with ``edit(header)`` keeping the array bytes."""
    buf = encode_group(g)
    magic, hlen = struct.unpack_from("<4sI", buf)
    header = msgpack.unpackb(buf[8:8 + hlen])
    start = 8 + hlen + (-(8 + hlen)) % 8
    data = buf[start:]
    edit(header)
    hdr = msgpack.packb(header)
    head = struct.pack("<4sI", magic, len(hdr)) + hdr
    return head + b"\0" * ((-len(head)) % 8) + data


@pytest.mark.parametrize(
    "edit,reason",
    [
        (lambda h: h.update(schema=2), "version"),
        (lambda h: h.update(schema="1"), "schema"),
        (lambda h: h.update(worker_id="3"), "schema"),
        (lambda h: h.update(worker_id=True), "schema"),
        (lambda h: h.pop("ticket"), "schema"),
        (lambda h: h.update(extra=1), "schema"),
        (lambda h: h["reward"].__setitem__(0, 1), "schema"),  # int where float is required
        (lambda h: h["finish_reason"].__setitem__(0, "abort"), "schema"),
        (lambda h: h["version_min"].pop(), "schema"),
        (lambda h: h["arrays"]["response_ids"].__setitem__(0, "|O"), "schema"),
        (lambda h: h["arrays"]["behavior_logprobs"].__setitem__(0, ">f4"), "schema"),
        (lambda h: h["lengths"].__setitem__(0, h["lengths"][0] + 1), "schema"),  # lengths vs array sizes
        (lambda h: h["arrays"]["behavior_logprobs"][1].__setitem__(0, 10**7), "malformed"),  # past the end
        (lambda h: h["timings"].update(gen_s="x"), "schema"),
        (lambda h: h.update(kind="control"), "schema"),
    ],
)
def test_decode_rejects_bad_headers(edit, reason):
    bad = _rebuild(make_group(), edit)
    with pytest.raises(WireError) as e:
        decode_group(bad)
    assert e.value.reason == reason, e.value


def test_decode_rejects_garbage_truncation_and_size():
    good = encode_group(make_group())
    for bad in [b"", b"garbage", b"APPO" + b"\xff" * 40, good[:-4], good + b"\0" * 8, good[:100]]:
        with pytest.raises(WireError) as e:
            decode_group(bad)
        assert e.value.reason == "malformed"
    with pytest.raises(WireError) as e:
        decode_group(good, max_bytes=len(good) - 1)
    assert e.value.reason == "oversized"
    assert_same(make_group(), decode_group(good, max_bytes=len(good)))
    with pytest.raises(WireError) as e:
        decode_group(12345)
    assert e.value.reason == "malformed"


def test_small_messages():
    spec = {"ping": {"n": int, "ok": bool}}
    assert decode_message(encode_message("ping", n=3, ok=True), spec) == ("ping", {"n": 3, "ok": True})
    cases = [
        (encode_message("ping", n=3), "schema"),
        (encode_message("ping", n=3, ok=1), "schema"),
        (encode_message("pong", n=3, ok=True), "schema"),
        (msgpack.packb({"schema": 99, "kind": "ping", "n": 3, "ok": True}), "version"),
        (b"\xc1", "malformed"),
        (encode_message("ping", n=3, ok=True, pad="x" * 100), "oversized"),
    ]
    for buf, reason in cases:
        with pytest.raises(WireError) as e:
            decode_message(buf, spec, max_bytes=100)
        assert e.value.reason == reason, (buf, e.value)
