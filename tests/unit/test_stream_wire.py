"""Wire format: exact round trip and rejection of everything that is not a well-formed group."""

import struct

import msgpack
import numpy as np
import pytest

from asyncppo.stream import wire
from asyncppo.stream.records import Sample, TrajectoryGroup, spans_from_token_versions
from asyncppo.stream.wire import WireError, decode_group, decode_message, encode_group, encode_message


def make_group(seed=0, n=8, T=512, ids_dtype=np.int32, lp_dtype=np.float32):
    """Odd samples come from one policy version (6, ``version_spans`` None); even ones switch from 5 to 6 after
    ``1 + j`` tokens (two spans), as when weights are swapped in the middle of a generation."""
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
            version_spans=None if j % 2 else np.array([[0, 5], [1 + j, 6]], dtype=np.int64),
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
        # None travels as the single span (0, version_min); explicit spans come back bit for bit
        assert x.spans().dtype == y.spans().dtype == np.int64 and x.spans().tobytes() == y.spans().tobytes()
        assert np.array_equal(x.token_versions(), y.token_versions())


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
    table_len = 33 * n
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


def _table_fmt(n):
    return f"<{n}I{n}d{n}q{n}q{n}B{n}I"


def _retable(g, edit):
    """Encode, then rewrite the binary sample table with ``edit(lengths, rewards, vmin, vmax, flags, counts)``."""
    header, table, data = _split(encode_group(g))
    n = header[F["n"]]
    vals = list(struct.unpack(_table_fmt(n), table))
    cols = [vals[i * n:(i + 1) * n] for i in range(6)]
    edit(*cols)
    return _join(header, struct.pack(_table_fmt(n), *sum(cols, [])), data)


def _respan(g, edit):
    """Encode, then rewrite the span region (and the table's span counts) with ``edit(spans, vmin, vmax)``:
    ``spans`` is a list (one per sample) of lists of [start, version]; ``vmin``/``vmax`` are the table's columns.
    Edit them in place; the frame is rebuilt consistently, so only the span rules can reject it."""
    header, table, data = _split(encode_group(g))
    n = header[F["n"]]
    vals = list(struct.unpack(_table_fmt(n), table))
    cols = [vals[i * n:(i + 1) * n] for i in range(6)]
    counts = cols[5]
    flat = list(struct.unpack(f"<{2 * sum(counts)}q", data[len(data) - 16 * sum(counts):]))
    spans, k = [], 0
    for c in counts:
        spans.append([flat[2 * i:2 * i + 2] for i in range(k, k + c)])
        k += c
    edit(spans, cols[2], cols[3])
    cols[5] = [len(sp) for sp in spans]
    new_flat = [x for sp in spans for row in sp for x in row]
    data = data[:len(data) - 16 * sum(counts)] + struct.pack(f"<{len(new_flat)}q", *new_flat)
    return _join(header, struct.pack(_table_fmt(n), *sum(cols, [])), data)


def test_layout_is_as_documented():
    g = make_group(n=2, T=5)
    header, table, data = _split(encode_group(g))
    assert header == [wire.SCHEMA_VERSION, "group", "3-0", 3, 0, 100, "42", g.timings, 2, "<i4", 37, "<i4", "<f4"]
    assert len(table) == 33 * 2
    v = struct.unpack("<2I2d2q2q2B2I", table)
    lengths, rewards, vmin, vmax, flags, counts = v[0:2], v[2:4], v[4:6], v[6:8], v[8:10], v[10:12]
    assert lengths == (5, 2) and vmin == (5, 6) and vmax == (6, 6)
    assert rewards == (g.samples[0].reward, g.samples[1].reward)
    assert flags == (1, 0)  # sample 0 stopped on length, sample 1 on a stop token; neither reward failed
    assert counts == (2, 1)  # sample 0: versions 5 then 6; sample 1: version_spans None -> one span
    prompt = g.prompt_ids.tobytes()
    ids = b"".join(s.response_ids.tobytes() for s in g.samples)
    lps = b"".join(s.behavior_logprobs.tobytes() for s in g.samples)
    spans = struct.pack("<6q", 0, 5, 1, 6, 0, 6)  # (start, version) pairs, all samples, int64 little-endian
    # 37*4 and 7*4 bytes each pad to 8
    assert data == prompt + b"\0" * 4 + ids + b"\0" * 4 + lps + b"\0" * 4 + spans


def _set(name, value):
    return lambda h: h.__setitem__(F[name], value)


@pytest.mark.parametrize(
    "edit,reason",
    [
        (_set("schema", 7), "version"),
        (_set("schema", 2), "version"),  # the previous layout (no version spans)
        (_set("schema", 3), None),  # control: the current version is accepted
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
    if reason is None:
        assert_same(make_group(), decode_group(bad))
        return
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
        (lambda L, r, v0, v1, f, c: f.__setitem__(0, 4), "schema"),  # unknown flag bit
        (lambda L, r, v0, v1, f, c: L.__setitem__(0, L[0] + 1), "malformed"),  # lengths no longer add up
        (lambda L, r, v0, v1, f, c: L.__setitem__(0, 2**32 - 1), "malformed"),  # absurd length: no allocation
        (lambda L, r, v0, v1, f, c: c.__setitem__(1, c[1] + 1), "malformed"),  # span counts no longer add up
        (lambda L, r, v0, v1, f, c: c.__setitem__(1, 2**32 - 1), "malformed"),  # absurd span count: no allocation
        (lambda L, r, v0, v1, f, c: v0.__setitem__(1, 5), "schema"),  # table's version_min disagrees with spans
        (lambda L, r, v0, v1, f, c: v1.__setitem__(0, 7), "schema"),  # table's version_max disagrees with spans
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
    out.samples[1].version_spans = np.array([[0, 0], [3, 6]])
    assert out.columns is None and out.version_min == 0 and out.samples[1].version_min == 0
    again = decode_group(encode_group(out))
    assert again.version_min == 0 and again.columns.version_spans.tolist() == [[0, 5], [1, 6], [0, 0], [3, 6], [0, 5],
                                                                                [3, 6]]


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


# --------------------------------------------------------------------------------------------- version spans


def _spans_group(T=(6, 0, 9, 1), seed=7):
    """Samples with 2, 1 (empty response), 3 and 1 (None) spans."""
    rng = np.random.default_rng(seed)
    spans = [np.array([[0, 3], [4, 5]]), np.array([[0, 4]]), np.array([[0, 1], [2, 2], [8, 7]]), None]
    vers = [(3, 5), (4, 4), (1, 7), (2, 2)]
    samples = [
        Sample(rng.integers(0, 100, t, dtype=np.int32), (-rng.random(t)).astype(np.float32), float(j), "stop",
               v0, v1, False, sp)
        for j, (t, sp, (v0, v1)) in enumerate(zip(T, spans, vers))
    ]
    return TrajectoryGroup("9-1", 9, np.arange(3, dtype=np.int32), samples)


def test_multi_span_round_trip_is_bit_exact_and_columnar():
    g = _spans_group()
    out = decode_group(encode_group(g))
    assert out.columns is not None
    c = out.columns
    assert c.span_offsets == [0, 2, 3, 6, 7]
    assert c.version_spans.dtype == np.int64 and c.version_spans.shape == (7, 2)
    assert c.version_spans.tolist() == [[0, 3], [4, 5], [0, 4], [0, 1], [2, 2], [8, 7], [0, 2]]
    assert not c.version_spans.flags.writeable  # a zero-copy view of the frame, like the token arrays
    again = decode_group(encode_group(out))  # re-encode from the columns, no Sample objects built
    assert out.columns is not None and again.columns.version_spans.tobytes() == c.version_spans.tobytes()
    assert again.columns.span_offsets == c.span_offsets
    assert_same(g, again)
    assert_same(g, out)  # materialises: every sample gets its slice of the spans
    assert out.samples[0].version_spans.tolist() == [[0, 3], [4, 5]]
    assert out.samples[3].version_spans.tolist() == [[0, 2]]


def test_token_versions_and_lag_sum_by_hand():
    s = Sample(np.zeros(6, np.int32), np.zeros(6, np.float32), 0.0, "stop", 3, 5, False, np.array([[0, 3], [4, 5]]))
    assert s.token_versions().tolist() == [3, 3, 3, 3, 5, 5] and s.token_versions().dtype == np.int64
    g = TrajectoryGroup("0-0", 0, np.zeros(1, np.int32), [s])
    assert g.token_lag_sum(7) == (20, 6)  # lags 4, 4, 4, 4, 2, 2
    assert decode_group(encode_group(g)).token_lag_sum(7) == (20, 6)  # columnar: from the spans, vectorised
    one = Sample(np.zeros(3, np.int32), np.zeros(3, np.float32), 0.0, "stop", 4, 4)
    assert one.token_versions().tolist() == [4, 4, 4]
    assert Sample(np.zeros(0, np.int32), np.zeros(0, np.float32), 0.0, "stop", 4, 4).token_versions().shape == (0,)


def test_token_lag_sum_matches_expansion():
    g = _spans_group()
    expect_tokens = sum(s.num_tokens for s in g.samples)
    expect = int(sum((10 - s.token_versions()).sum() for s in g.samples))
    assert [s.token_versions().tolist() for s in g.samples] == [
        [3, 3, 3, 3, 5, 5], [], [1, 1, 2, 2, 2, 2, 2, 2, 7], [2]]
    assert g.token_lag_sum(10) == (expect, expect_tokens) == (7 * 4 + 5 * 2 + 9 * 2 + 8 * 6 + 3 + 8, 16)
    out = decode_group(encode_group(g))
    assert out.token_lag_sum(10) == (expect, expect_tokens)
    assert out.columns is not None  # computing the lag did not materialise the samples
    big = make_group(3)
    assert decode_group(encode_group(big)).token_lag_sum(9) == big.token_lag_sum(9) == (
        int(sum((9 - s.token_versions()).sum() for s in big.samples)), big.num_response_tokens)


def test_spans_from_token_versions():
    v = np.array([3, 3, 3, 3, 5, 5])
    sp = spans_from_token_versions(v)
    assert sp.dtype == np.int64 and sp.tolist() == [[0, 3], [4, 5]]
    assert spans_from_token_versions(np.array([7])).tolist() == [[0, 7]]
    assert spans_from_token_versions(np.zeros(0, np.int64), default_version=4).tolist() == [[0, 4]]
    with pytest.raises(ValueError, match="default_version"):
        spans_from_token_versions(np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="decreases at token 2"):
        spans_from_token_versions(np.array([1, 2, 1]))
    rng = np.random.default_rng(0)
    for _ in range(20):
        tv = np.cumsum(rng.integers(0, 2, rng.integers(1, 30)) * rng.integers(1, 4)) + rng.integers(0, 5)
        s = Sample(np.zeros(len(tv), np.int32), np.zeros(len(tv), np.float32), 0.0, "stop", int(tv[0]), int(tv[-1]),
                   False, spans_from_token_versions(tv))
        assert s.token_versions().tolist() == tv.tolist()
        assert decode_group(encode_group(TrajectoryGroup("r", 0, np.zeros(1, np.int32), [s]))).samples[0] \
            .token_versions().tolist() == tv.tolist()


def _edit_sample(j, fn):
    def edit(spans, vmin, vmax):
        fn(spans[j], vmin, vmax)
    return edit


# Each rule of the span validation, broken in exactly one sample of a frame that is otherwise consistent.
# _spans_group: sample 0 has 6 tokens, spans (0,3),(4,5); 1: 0 tokens, (0,4); 2: 9 tokens, (0,1),(2,2),(8,7); 3: (0,2).
SPAN_VIOLATIONS = [
    ("count_zero", 3, lambda sp, v0, v1: sp.clear(), "at least one"),
    ("count_over_tokens", 1, lambda sp, v0, v1: (sp.append([1, 5]), v1.__setitem__(1, 5)), "spans"),
    ("first_start_nonzero", 0, lambda sp, v0, v1: sp[0].__setitem__(0, 1), "first start"),
    ("starts_not_increasing", 2, lambda sp, v0, v1: sp[1].__setitem__(0, 8), "starts"),
    ("starts_decreasing", 2, lambda sp, v0, v1: sp[2].__setitem__(0, 1), "starts"),
    ("start_past_end", 0, lambda sp, v0, v1: sp[1].__setitem__(0, 6), "num_tokens=6"),
    ("versions_not_increasing", 2, lambda sp, v0, v1: sp[1].__setitem__(1, 1), "versions"),
    ("versions_decreasing", 2, lambda sp, v0, v1: sp[1].__setitem__(1, 9), "versions"),
    ("first_version_not_min", 0, lambda sp, v0, v1: sp[0].__setitem__(1, 2), "version_min=3"),
    ("last_version_not_max", 0, lambda sp, v0, v1: sp[1].__setitem__(1, 6), "version_max=5"),
    ("negative_version", 3, lambda sp, v0, v1: (sp[0].__setitem__(1, -2), v0.__setitem__(3, -2),
                                                 v1.__setitem__(3, -2)), ">= 0"),
]


@pytest.mark.parametrize("name,j,fn,msg", SPAN_VIOLATIONS, ids=[v[0] for v in SPAN_VIOLATIONS])
def test_decode_rejects_each_span_rule(name, j, fn, msg):
    bad = _respan(_spans_group(), _edit_sample(j, fn))
    with pytest.raises(WireError, match=msg) as e:
        decode_group(bad)
    assert e.value.reason == "schema", e.value
    assert f"samples[{j}]" in e.value.detail  # names the sample


def test_respan_helper_without_edit_is_identity():
    g = _spans_group()
    assert _respan(g, lambda *a: None) == encode_group(g)


def test_decode_bounds_total_spans():
    # 2 spans more than tokens + samples, with the bytes present: refused by the bound, before any span is read
    def edit(spans, vmin, vmax):
        spans[1].extend([[1, 5], [2, 6], [3, 7], [4, 8], [5, 9], [6, 10], [7, 11], [8, 12], [9, 13], [10, 14],
                         [11, 15], [12, 16], [13, 17], [14, 18], [15, 19], [16, 20], [17, 21], [18, 22]])
    with pytest.raises(WireError, match="add up to") as e:
        decode_group(_respan(_spans_group(), edit))
    assert e.value.reason == "schema"


@pytest.mark.parametrize("name,j,fn,msg", SPAN_VIOLATIONS, ids=[v[0] for v in SPAN_VIOLATIONS])
def test_encode_rejects_each_span_rule(name, j, fn, msg):
    g = _spans_group()
    s = g.samples[j]
    spans = s.spans().tolist()
    vmin, vmax = [x.version_min for x in g.samples], [x.version_max for x in g.samples]
    fn(spans, vmin, vmax)
    s.version_spans = np.array(spans, dtype=np.int64).reshape(-1, 2)
    s.version_min, s.version_max = vmin[j], vmax[j]
    with pytest.raises(WireError, match=msg) as e:
        encode_group(g)
    assert e.value.reason == "schema" and f"samples[{j}]" in e.value.detail


@pytest.mark.parametrize("name,j,fn,msg", SPAN_VIOLATIONS, ids=[v[0] for v in SPAN_VIOLATIONS])
def test_encode_rejects_each_span_rule_from_columns(name, j, fn, msg, monkeypatch):
    """A columnar group whose spans were tampered with after decoding is refused when re-encoded."""
    monkeypatch.setattr(wire, "_check_spans", lambda *a, **k: None)  # let the bad frame decode
    out = decode_group(_respan(_spans_group(), _edit_sample(j, fn)))
    monkeypatch.undo()
    assert out.columns is not None
    with pytest.raises(WireError, match=msg) as e:
        encode_group(out)
    assert e.value.reason == "schema" and f"samples[{j}]" in e.value.detail


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda g: setattr(g.samples[3], "version_max", 3), r"samples\[3\]: version_min=2 != version_max=3"),
        (lambda g: setattr(g.samples[0], "version_spans", [[0, 3], [4, 5]]), r"samples\[0\]\.version_spans must"),
        (lambda g: setattr(g.samples[0], "version_spans", np.array([0, 3])), r"shape \(2,\)"),
        (lambda g: setattr(g.samples[0], "version_spans", np.array([[0.0, 3.0]])), "float64"),
        (lambda g: g.samples.__setitem__(3, Sample(np.zeros(2, np.int32), np.zeros(2, np.float32), 0.0, "stop", 1,
                                                   2)), r"samples\[3\]: version_min=1 != version_max=2"),
        (lambda g: [setattr(s, "version_spans", None) for s in g.samples[:1]], r"samples\[0\]: version_min=3"),
    ],
)
def test_encode_refuses_malformed_spans(mutate, msg):
    g = _spans_group()
    mutate(g)
    with pytest.raises(WireError, match=msg) as e:
        encode_group(g)
    assert e.value.reason == "schema"


def test_encode_refuses_two_versions_without_spans_in_the_fast_path():
    g = make_group(n=3)
    for s in g.samples:
        s.version_spans = None
    with pytest.raises(WireError, match=r"samples\[0\]: version_min=5 != version_max=6") as e:
        encode_group(g)
    assert e.value.reason == "schema"
    for s in g.samples:
        s.version_min = -1
        s.version_max = -1
    with pytest.raises(WireError, match=r"samples\[0\].*>= 0"):
        encode_group(g)


def test_encode_refuses_inconsistent_span_columns():
    out = decode_group(encode_group(_spans_group()))
    c = out.columns
    out._columns = c._replace(span_offsets=[0, 2, 3, 6, 6])
    with pytest.raises(WireError, match="span_offsets") as e:
        encode_group(out)
    assert e.value.reason == "schema"
    out._columns = c._replace(version_spans=c.version_spans[:, :1])
    with pytest.raises(WireError, match="shape") as e:
        encode_group(out)
    assert e.value.reason == "schema"


def test_decode_rejects_spans_that_only_look_ordered_through_int64_wraparound():
    # starts 0, 2**63-1, -2**63: the second step wraps to +1 in int64 and the last start is "< num_tokens"
    def edit(spans, vmin, vmax):
        spans[2][1][0] = 2**63 - 1
        spans[2][2][0] = -(2**63)
    with pytest.raises(WireError) as e:
        decode_group(_respan(_spans_group(), edit))
    assert e.value.reason == "schema" and "samples[2]" in e.value.detail

    def edit_versions(spans, vmin, vmax):  # same trick on the versions column
        spans[2][1][1] = 2**63 - 1
        spans[2][2][1] = -(2**63)
        vmax[2] = -(2**63)
    with pytest.raises(WireError) as e:
        decode_group(_respan(_spans_group(), edit_versions))
    assert e.value.reason == "schema" and "samples[2]" in e.value.detail
