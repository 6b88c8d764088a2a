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


F = {name: i for i, (name, _) in enumerate(wire.HEADER_FIELDS)}


def _split(buf):
    """(header list, sample table bytes, array bytes) of an encoded group."""
    magic, hlen = struct.unpack_from("<4sI", buf)
    header = msgpack.unpackb(buf[8:8 + hlen])
    start = 8 + hlen + (-(8 + hlen)) % 8
    n = header[F["n"]]
    table_len = 29 * n
    return header, buf[start:start + table_len], buf[start + table_len + (-table_len) % 8:]


def _join(header, table, data):
    hdr = msgpack.packb(header)
    head = struct.pack("<4sI", b"APPO", len(hdr)) + hdr
    return head + b"\0" * ((-len(head)) % 8) + table + b"\0" * ((-len(table)) % 8) + data


def _rebuild(g, edit):
    """Encode, then rewrite the msgpack header with ``edit(header)`` keeping the table and array bytes."""
    header, table, data = _split(encode_group(g))
    edit(header)
    return _join(header, table, data)


def _retable(g, edit):
    """Encode, then rewrite the binary sample table with ``edit(lengths, rewards, vmin, vmax, flags)``."""
    header, table, data = _split(encode_group(g))
    n = header[F["n"]]
    vals = list(struct.unpack(f"<{n}I{n}d{n}q{n}q{n}B", table))
    cols = [vals[i * n:(i + 1) * n] for i in range(5)]
    edit(*cols)
    return _join(header, struct.pack(f"<{n}I{n}d{n}q{n}q{n}B", *sum(cols, [])), data)


def test_layout_is_as_documented():
    g = make_group(n=2, T=5)
    header, table, data = _split(encode_group(g))
    assert header == [wire.SCHEMA_VERSION, "group", "3-0", 3, 0, 100, "42", g.timings, 2, "<i4", 37, "<i4", "<f4"]
    v = struct.unpack("<2I2d2q2q2B", table)
    lengths, rewards, vmin, vmax, flags = v[0:2], v[2:4], v[4:6], v[6:8], v[8:10]
    assert lengths == (5, 2) and vmin == (5, 6) and vmax == (6, 6)
    assert rewards == (g.samples[0].reward, g.samples[1].reward)
    assert flags == (1, 0)  # sample 0 stopped on length, sample 1 on a stop token; neither reward failed
    prompt = g.prompt_ids.tobytes()
    ids = b"".join(s.response_ids.tobytes() for s in g.samples)
    lps = b"".join(s.behavior_logprobs.tobytes() for s in g.samples)
    assert data == prompt + b"\0" * 4 + ids + b"\0" * 4 + lps  # 37*4 and 7*4 bytes each pad to 8


def _set(name, value):
    return lambda h: h.__setitem__(F[name], value)


@pytest.mark.parametrize(
    "edit,reason",
    [
        (_set("schema", 7), "version"),
        (_set("schema", "2"), "schema"),
        (_set("worker_id", "3"), "schema"),
        (_set("worker_id", True), "schema"),  # bool is not accepted where int is wanted
        (lambda h: h.pop(F["ticket"]), "schema"),
        (lambda h: h.append(1), "schema"),
        (_set("kind", "control"), "schema"),
        (_set("n", 0), "schema"),
        (_set("n", 10**6), "schema"),
        (_set("response_dtype", "|O"), "schema"),
        (_set("logprob_dtype", ">f4"), "schema"),  # big-endian: never byte-swapped silently
        (_set("prompt_dtype", "<f4"), "schema"),
        (_set("prompt_len", -1), "schema"),
        (_set("prompt_len", 10**7), "malformed"),  # runs past the end
        (_set("prompt_len", 36), "malformed"),  # regions no longer end where the frame does
        (_set("n", 7), "malformed"),
        (lambda h: h[F["timings"]].update(gen_s="x"), "schema"),
        (lambda h: h[F["timings"]].update({1: 1.0}), "malformed"),  # msgpack refuses non-str map keys
    ],
)
def test_decode_rejects_bad_headers(edit, reason):
    bad = _rebuild(make_group(), edit)
    with pytest.raises(WireError) as e:
        decode_group(bad)
    assert e.value.reason == reason, e.value


def test_decode_rejects_a_version_1_map_header_as_version():
    hdr = msgpack.packb({"schema": 1, "kind": "group"})
    with pytest.raises(WireError) as e:
        decode_group(struct.pack("<4sI", b"APPO", len(hdr)) + hdr)
    assert e.value.reason == "version" and "schema version 1" in str(e.value)


@pytest.mark.parametrize(
    "edit,reason",
    [
        (lambda L, r, v0, v1, f: f.__setitem__(0, 4), "schema"),  # unknown flag bit
        (lambda L, r, v0, v1, f: L.__setitem__(0, L[0] + 1), "malformed"),  # lengths no longer add up
        (lambda L, r, v0, v1, f: L.__setitem__(0, 2**32 - 1), "malformed"),  # absurd length: no allocation
    ],
)
def test_decode_rejects_bad_sample_tables(edit, reason):
    with pytest.raises(WireError) as e:
        decode_group(_retable(make_group(), edit))
    assert e.value.reason == reason, e.value


def test_decoded_group_is_columnar_until_samples_are_touched():
    g = make_group(4, n=3, T=10)
    out = decode_group(encode_group(g))
    assert out.columns is not None and out.columns.offsets == [0, 10, 17, 21]
    assert (out.num_samples, out.num_response_tokens, out.version_min, out.version_max) == (3, 21, 5, 6)
    assert decode_group(encode_group(out)).columns.offsets == [0, 10, 17, 21]  # re-encoding columns works
    assert_same(g, decode_group(encode_group(out)))
    out.samples[1].version_min = 0  # after materialising, the samples are the truth
    assert out.columns is None and out.version_min == 0 and out.samples[1].version_min == 0
    assert decode_group(encode_group(out)).version_min == 0


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda g: setattr(g.samples[2], "version_min", 1.5), r"samples\[2\]\.version_min=1\.5"),
        (lambda g: setattr(g.samples[0], "reward", "x"), r"samples\[0\]\.reward='x'"),
        (lambda g: setattr(g.samples[0], "version_max", 2**63), "version_max"),
    ],
)
def test_encode_names_unrepresentable_scalars(mutate, msg):
    g = make_group()
    mutate(g)
    with pytest.raises(WireError, match=msg) as e:
        encode_group(g)
    assert e.value.reason == "schema"


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
