"""Wire format for trajectory groups and small control messages.

Why this layout
---------------
A trajectory group is a few scalars per sample plus a few large token arrays. Shipping the arrays through a
generic serialiser (pickle, msgpack ``bin`` fields) copies them several times and, for pickle, lets a peer run
code in the learner. Multipart ZeroMQ messages (one frame per array) cost more per message than the bytes they
save. So a group travels as **one frame**::

    b"APPO" | uint32 LE header length | msgpack header (an array) | pad to 8
    | sample table | pad to 8 | prompt ids | pad to 8 | response ids (all samples) | pad to 8 | log-probs (all)
    | pad to 8 | version spans (all)

* header: ``[schema, "group", group_id, worker_id, prompt_index, ticket, answer, timings, n,
  prompt dtype, prompt length, response-id dtype, log-prob dtype]`` (see :data:`HEADER_FIELDS`);
* sample table: ``n`` x uint32 response length, ``n`` x float64 reward, ``n`` x int64 version_min, ``n`` x int64
  version_max, ``n`` x uint8 flags (bit 0: finish_reason is "length", bit 1: reward_failed), ``n`` x uint32 span
  count, all little-endian (``33 * n`` bytes);
* version spans: for each sample in order, its ``span count`` rows of (int64 start_token_index, int64 version),
  little-endian; ``16 * sum(span counts)`` bytes. A sample whose ``Sample.version_spans`` is None travels as the
  single span ``(0, version_min)``, so every decoded sample has at least one span (see
  :mod:`asyncppo.stream.records` for what spans mean).
* turns (multi-turn episodes only): a 14th header field ``turns`` and, after the version spans, the
  environment-segment run-lengths and per-turn rewards (:mod:`asyncppo.stream.turn_wire`). Single-turn groups have
  neither, so their frames are exactly the frames of before.
* routing (mixture-of-experts policies only): a last header field ``[layers, top_k, dtype]`` and, ending the frame,
  the engine's expert ids for every position of every sample (:mod:`asyncppo.stream.routing`).

Every offset follows from the header and the table, so the receiver computes the exact frame length and refuses
any other. The design goal is *few Python operations per message*, because on a small machine the stream's
throughput is bounded by per-message interpreter time, not by bytes: the table is one ``struct`` call each way
(which also fixes every scalar's type, so nothing needs a per-value type check), the header is a short msgpack
array checked with one tuple comparison, the sender concatenates all response ids and all log-probs into one
region each (it copies them into the frame anyway), and the receiver takes zero-copy ``np.frombuffer`` views.
Decoded groups are columnar (:meth:`TrajectoryGroup.from_columns`): arrays are **read-only views** that keep the
received frame alive (copy them, ``np.array(x)``, before writing), and ``Sample`` objects are built on first use.

Nothing here trusts the peer: :func:`decode_group` checks the type of every header field, the dtype whitelist,
the flag values, that the frame is exactly as long as the header and table say, that every alignment pad is zero
(else a header could under-state a length and cut data short), the schema version, and the version spans
(content - vocabulary, finiteness, limits, tickets - is :mod:`asyncppo.stream.validate`'s job), and raises
:class:`WireError` with a short reason code:

* ``malformed`` - not parseable: bad magic, bad msgpack, a frame of the wrong length for what it declares;
* ``oversized`` - longer than the receiver's limit (checked before anything is parsed);
* ``version``   - a schema version other than :data:`SCHEMA_VERSION`;
* ``schema``    - parseable, but a field is missing, of the wrong type or has a disallowed value.

The version spans of each sample must satisfy (checked vectorised over the whole concatenated spans array, with a
per-sample walk only on the error path to name the offending sample; :func:`encode_group` applies the same
checks, so a worker bug is reported at the sender): ``1 <= span count <= max(num_tokens, 1)``; the first start is
0, starts strictly increase and are ``< num_tokens`` (when ``num_tokens > 0``); versions are ``>= 0`` and strictly
increase; the first version equals the table's ``version_min`` and the last its ``version_max``. The sum of the
span counts is also bounded by ``total tokens + n`` (the exact frame-length check comes first, so a hostile count
can never make the reader allocate more than the frame holds).

The prefix, the msgpack rules and the small control messages (:func:`encode_message` / :func:`decode_message`,
re-exported here) belong to :mod:`asyncppo.stream.framing`, the one framing every message type uses.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any

import numpy as np

# REASONS and WireError live in errors.py (spans.py raises WireError too) and are re-exported from here, as is
# check_spans (its historical import site).
from asyncppo.stream.errors import REASONS, WireError  # noqa: F401
# The small control messages are framed by framing.py and re-exported here, their historical import site.
from asyncppo.stream.framing import ZEROS as _ZEROS
from asyncppo.stream.framing import as_view as _as_view
from asyncppo.stream.framing import decode_message, encode_message  # noqa: F401
from asyncppo.stream.framing import header_end as _header_end
from asyncppo.stream.framing import header_parts, read_header
from asyncppo.stream.framing import pad as _pad
from asyncppo.stream.framing import up as _up
from asyncppo.stream import routing as _routing
from asyncppo.stream.records import SampleColumns, TrajectoryGroup, check_spans  # noqa: F401
from asyncppo.stream.spans import _I8, _bad_spans, _check_spans, _span_counts, _spans_region
from asyncppo.stream.turn_wire import TURNS_FORMAT, group_turns, pop_turns_field, read_turn_region, turn_region

#: Version 3: per-token policy versions (a span count per sample in the table, a version-span region at the end).
#: Version 2: columnar sample table (version 1 carried the per-sample scalars as msgpack lists in a map header).
SCHEMA_VERSION = 3
MAGIC = b"APPO"
#: Most samples one group may declare (bounds the table a hostile header can make us parse).
MAX_SAMPLES = 4096

FINISH_REASONS = ("stop", "length")
_FINISH_CODE = {"stop": 0, "length": 1}
_FAILED_BIT = 2

#: dtype strings allowed per array region. Little-endian only: the format is defined as little-endian and
#: we never byte-swap silently (a swap would break the bit-exact round trip promise).
ALLOWED_DTYPES: dict[str, tuple[str, ...]] = {
    "prompt_ids": ("<i4", "<i8"),
    "response_ids": ("<i4", "<i8"),
    "behavior_logprobs": ("<f4", "<f8", "<f2"),
}
_DTYPE_BY_STR = {d: np.dtype(d) for v in ALLOWED_DTYPES.values() for d in v}
_DTYPE_OBJS: dict[str, frozenset] = {k: frozenset(np.dtype(d) for d in v) for k, v in ALLOWED_DTYPES.items()}

#: The header array, in order, with the exact Python type msgpack decodes each field to (bool is not int).
HEADER_FIELDS: tuple[tuple[str, type], ...] = (
    ("schema", int),
    ("kind", str),
    ("group_id", str),
    ("worker_id", int),
    ("prompt_index", int),
    ("ticket", int),
    ("answer", str),
    ("timings", dict),
    ("n", int),
    ("prompt_dtype", str),
    ("prompt_len", int),
    ("response_dtype", str),
    ("logprob_dtype", str),
)
_HEADER_TYPES = tuple(t for _, t in HEADER_FIELDS)
_STR, _FLOAT = frozenset({str}), frozenset({float})
_TABLE_BYTES_PER_SAMPLE = 4 + 8 + 8 + 8 + 1 + 4
_SPAN_BYTES = 16  # one (int64 start, int64 version) row
_TABLES: dict[int, struct.Struct] = {}


def _table(n: int) -> struct.Struct:
    """The sample-table codec for ``n`` samples (cached: groups almost always have the same size)."""
    st = _TABLES.get(n)
    if st is None:
        st = struct.Struct(f"<{n}I{n}d{n}q{n}q{n}B{n}I")
        if len(_TABLES) < 64:
            _TABLES[n] = st
    return st


# --------------------------------------------------------------------------------------------- encode


_ND = frozenset({np.ndarray})
_ONE = frozenset({1})


def _bad_array(name: str, arr: Any, where: str) -> WireError:
    """The precise complaint about an array that failed a fast check."""
    if not isinstance(arr, np.ndarray):
        return WireError("schema", f"{where}{name} must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != 1:
        return WireError("schema", f"{where}{name} must be 1-D, got shape {arr.shape}")
    return WireError("schema", f"{where}{name} has dtype {arr.dtype.str}; allowed: {ALLOWED_DTYPES[name]}")


def _explain_samples(samples: list) -> WireError:
    """Walk the samples one by one to name the first thing :func:`encode_group`'s bulk checks refused. Only runs
    on the error path, so it can afford to be a plain loop."""
    ids_dt = lp_dt = None
    for j, s in enumerate(samples):
        a, b = s.response_ids, s.behavior_logprobs
        if type(a) is not np.ndarray or a.ndim != 1 or a.dtype not in _DTYPE_OBJS["response_ids"]:
            return _bad_array("response_ids", a, f"samples[{j}].")
        if type(b) is not np.ndarray or b.ndim != 1 or b.dtype not in _DTYPE_OBJS["behavior_logprobs"]:
            return _bad_array("behavior_logprobs", b, f"samples[{j}].")
        if ids_dt is None:
            ids_dt, lp_dt = a.dtype, b.dtype
        elif a.dtype != ids_dt or b.dtype != lp_dt:
            return WireError("schema", f"samples[{j}]: all samples of a group must share dtypes ({ids_dt}, {lp_dt})")
        if a.shape[0] != b.shape[0]:
            return WireError(
                "schema", f"samples[{j}]: len(response_ids)={a.shape[0]} != len(behavior_logprobs)={b.shape[0]}"
            )
        if not isinstance(s.finish_reason, str) or s.finish_reason not in _FINISH_CODE:
            return WireError("schema", f"samples[{j}].finish_reason={s.finish_reason!r}; allowed: {FINISH_REASONS}")
    return WireError("schema", "samples could not be encoded")


def _pack_table(n: int, lengths: list, rewards: list, vmin: list, vmax: list, flags: list, counts: list) -> bytes:
    try:
        return _table(n).pack(*lengths, *rewards, *vmin, *vmax, *flags, *counts)
    except struct.error:
        pass
    for name, code, col in (("reward", "d", rewards), ("version_min", "q", vmin), ("version_max", "q", vmax)):
        for j, v in enumerate(col):
            try:
                struct.pack("<" + code, v)
            except struct.error as e:
                raise WireError("schema", f"samples[{j}].{name}={v!r} is not representable ({e})") from None
    raise WireError("schema", f"a response is longer than {2**32 - 1} tokens")


def _column_parts(group: TrajectoryGroup) -> tuple:
    """(ids parts, logprob parts, ids dtype, logprob dtype, lengths, rewards, vmin, vmax, flags, span counts,
    span source) where the span source is the samples' ``version_spans`` list or the columns' spans array.

    Checks run over whole columns (set comprehensions in C) rather than field by field; only when one fails does
    :func:`_explain_samples` walk the samples to say which and why. Scalar types are enforced by ``struct``."""
    cols = group.columns
    if cols is not None:  # a group that came off the wire and was never unpacked into Sample objects
        ids, lps, off = cols.response_ids, cols.behavior_logprobs, cols.offsets
        if type(ids) is not np.ndarray or ids.ndim != 1 or ids.dtype not in _DTYPE_OBJS["response_ids"]:
            raise _bad_array("response_ids", ids, "columns.")
        if type(lps) is not np.ndarray or lps.ndim != 1 or lps.dtype not in _DTYPE_OBJS["behavior_logprobs"]:
            raise _bad_array("behavior_logprobs", lps, "columns.")
        lengths = [b - a for a, b in zip(off, off[1:])]
        if off[0] != 0 or off[-1] != ids.shape[0] or ids.shape[0] != lps.shape[0] or min(lengths, default=0) < 0:
            raise WireError("schema", f"columns: offsets {off} do not cover arrays of {ids.shape[0]}/{lps.shape[0]}")
        try:
            flags = [_FINISH_CODE[f] | (_FAILED_BIT if bad else 0)
                     for f, bad in zip(cols.finish_reason, cols.reward_failed)]
        except (KeyError, TypeError):
            raise WireError("schema", f"finish_reason {list(cols.finish_reason)}; allowed: {FINISH_REASONS}") from None
        spans, soff = cols.version_spans, list(cols.span_offsets)
        if type(spans) is not np.ndarray or spans.ndim != 2 or spans.shape[1] != 2 or spans.dtype.kind not in "iu":
            raise _bad_spans(spans, "columns.")
        counts = [b - a for a, b in zip(soff, soff[1:])]
        if len(soff) != len(off) or soff[0] != 0 or soff[-1] != spans.shape[0] or min(counts, default=0) < 0:
            raise WireError("schema", f"columns: span_offsets {soff} do not cover {spans.shape[0]} spans of "
                                      f"{len(lengths)} samples")
        return [ids], [lps], ids.dtype, lps.dtype, lengths, list(cols.reward), list(cols.version_min), \
            list(cols.version_max), flags, counts, spans
    samples = group.samples
    ids = [s.response_ids for s in samples]
    lps = [s.behavior_logprobs for s in samples]
    if set(map(type, ids)) != _ND or set(map(type, lps)) != _ND:
        raise _explain_samples(samples)
    ids_dts = {a.dtype for a in ids}
    lp_dts = {b.dtype for b in lps}
    if (
        len(ids_dts) != 1 or len(lp_dts) != 1
        or not ids_dts <= _DTYPE_OBJS["response_ids"] or not lp_dts <= _DTYPE_OBJS["behavior_logprobs"]
        or {a.ndim for a in ids} != _ONE or {b.ndim for b in lps} != _ONE
    ):
        raise _explain_samples(samples)
    lengths = [a.shape[0] for a in ids]
    if [b.shape[0] for b in lps] != lengths:
        raise _explain_samples(samples)
    try:
        flags = [_FINISH_CODE[s.finish_reason] | (_FAILED_BIT if s.reward_failed else 0) for s in samples]
    except (KeyError, TypeError):
        raise _explain_samples(samples) from None
    vspans = [s.version_spans for s in samples]
    return (ids, lps, ids_dts.pop(), lp_dts.pop(), lengths, [s.reward for s in samples],
            [s.version_min for s in samples], [s.version_max for s in samples], flags, _span_counts(vspans), vspans)


def encode_group(group: TrajectoryGroup) -> bytes:
    """Serialise ``group`` into one frame (see module docstring). Raises :class:`WireError` ("schema") when the
    group cannot be represented exactly (wrong or mixed dtypes, length mismatch, bad finish_reason, version spans
    that break the span rules, ...).

    The work is a fixed number of bulk operations per group plus one ``b"".join`` copy of the arrays."""
    n = group.num_samples
    if n == 0:
        raise WireError("schema", "a group needs at least one sample")
    if n > MAX_SAMPLES:
        raise WireError("schema", f"{n} samples > MAX_SAMPLES={MAX_SAMPLES}")
    prompt = group.prompt_ids
    if type(prompt) is not np.ndarray or prompt.ndim != 1 or prompt.dtype not in _DTYPE_OBJS["prompt_ids"]:
        raise _bad_array("prompt_ids", prompt, "")
    id_parts, lp_parts, ids_dt, lp_dt, lengths, rewards, vmin, vmax, flags, counts, span_src = _column_parts(group)
    table = _pack_table(n, lengths, rewards, vmin, vmax, flags, counts)  # also checks every scalar's type
    spans = _spans_region(span_src, counts, lengths, vmin, vmax)
    turns = group_turns(group)  # multi-turn episodes only (asyncppo.stream.turn_wire)
    turn_parts = [] if turns is None else turn_region(turns, lengths)
    try:
        timings = {str(k): float(v) for k, v in group.timings.items()}
        header = [SCHEMA_VERSION, "group", str(group.group_id), int(group.worker_id), int(group.prompt_index),
                  int(group.ticket), str(group.answer), timings, n, prompt.dtype.str, prompt.shape[0],
                  ids_dt.str, lp_dt.str] + ([] if turns is None else [TURNS_FORMAT])
        if group.routing is not None:
            header.append(_routing.header_field(group.routing, prompt.shape[0], lengths))
        parts: list[Any] = header_parts(MAGIC, header)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError("schema", f"group scalars are not representable: {e}") from None
    total = sum(lengths)
    parts += [table, _ZEROS[: _pad(len(table))], prompt, _ZEROS[: _pad(prompt.nbytes)]]
    parts += id_parts
    parts.append(_ZEROS[: _pad(total * ids_dt.itemsize)])
    parts += lp_parts
    parts.append(_ZEROS[: _pad(total * lp_dt.itemsize)])
    parts.append(spans)
    parts += turn_parts
    if group.routing is not None:
        parts.append(group.routing.experts)
    try:
        return b"".join(parts)  # numpy arrays are bytes-like when C-contiguous
    except TypeError:  # some array is a strided view: copy those into contiguous memory first
        return b"".join(np.ascontiguousarray(p) if isinstance(p, np.ndarray) else p for p in parts)


# --------------------------------------------------------------------------------------------- decode


def _unpack_header(mv: memoryview, max_bytes: int | None, container: type) -> tuple[Any, int]:
    header, data_start = read_header(mv, MAGIC, max_bytes)
    if type(header) is not container:
        # A map with a "schema" field is how other versions of this format begin: say so precisely.
        if type(header) is dict and type(header.get("schema")) is int and header["schema"] != SCHEMA_VERSION:
            raise WireError("version", f"schema version {header['schema']}, this reader speaks {SCHEMA_VERSION}")
        raise WireError("schema", f"header must be a msgpack {container.__name__}, got {type(header).__name__}")
    return header, data_start


def _explain_header(header: list) -> WireError:
    """Name the first header field that the one-comparison type check in :func:`decode_group` refused."""
    if len(header) != len(HEADER_FIELDS):
        return WireError("schema", f"header has {len(header)} fields, expected {[k for k, _ in HEADER_FIELDS]}")
    for (key, typ), val in zip(HEADER_FIELDS, header):
        if type(val) is not typ:
            return WireError("schema", f"group: field {key!r} must be {typ.__name__}, got {type(val).__name__}")
    return WireError("schema", "group: header fields do not match the schema")


def _dtype(name: str, dt: str) -> np.dtype:
    if dt not in ALLOWED_DTYPES[name]:
        raise WireError("schema", f"{name} dtype {dt!r} not allowed; allowed: {ALLOWED_DTYPES[name]}")
    return _DTYPE_BY_STR[dt]


_FINISH_BY_FLAGS = ("stop", "length", "stop", "length")
_FAILED_BY_FLAGS = (False, False, True, True)


def _checked_header(mv: memoryview, max_bytes: int | None) -> tuple[list, int]:
    """The group header with every field type-checked and its dtype strings resolved to numpy dtypes, and where
    the frame's data begins."""
    header, data_start = _unpack_header(mv, max_bytes, list)
    if header and type(header[0]) is int and header[0] != SCHEMA_VERSION:
        raise WireError("version", f"schema version {header[0]}, this reader speaks {SCHEMA_VERSION}")
    routing = _routing.pop_field(header, len(_HEADER_TYPES))  # the optional last field: an MoE policy's experts
    turns = pop_turns_field(header, len(_HEADER_TYPES))  # the optional trailing field: a multi-turn group
    if len(header) != len(_HEADER_TYPES) or tuple(map(type, header)) != _HEADER_TYPES:
        raise _explain_header(header)
    kind, timings, n, p_n = header[1], header[7], header[8], header[10]
    if kind != "group":
        raise WireError("schema", f"kind {kind!r}, expected 'group'")
    if n < 1 or n > MAX_SAMPLES:
        raise WireError("schema", f"n={n}: a group has 1..{MAX_SAMPLES} samples")
    if p_n < 0:
        raise WireError("schema", f"prompt_len={p_n} must be >= 0")
    if timings and (set(map(type, timings)) != _STR or set(map(type, timings.values())) != _FLOAT):
        bad = next((k, v) for k, v in timings.items() if type(k) is not str or type(v) is not float)
        raise WireError("schema", f"timings entry {bad[0]!r}: {bad[1]!r} must be str -> float")
    header[9] = _dtype("prompt_ids", header[9])
    header[11] = _dtype("response_ids", header[11])
    header[12] = _dtype("behavior_logprobs", header[12])
    return header + [turns, routing], data_start


def decode_group(buf: Any, max_bytes: int | None = None) -> TrajectoryGroup:
    """Parse and validate one frame produced by :func:`encode_group`; raise :class:`WireError` on anything else.

    Returns a columnar group (:meth:`TrajectoryGroup.from_columns`): its arrays are read-only views into ``buf``
    (zero copy) and its ``Sample`` objects are built on first access to ``group.samples``. Every check runs
    here, before the group is returned."""
    mv = _as_view(buf)
    size = mv.nbytes
    header, data_start = _checked_header(mv, max_bytes)
    (_, _, group_id, worker_id, prompt_index, ticket, answer, timings, n, p_dt, p_n, i_dt, l_dt, turns, routing) = header

    # Layout: every offset follows from the header and the table; the frame must end exactly where it says.
    table = _table(n)
    p_start = data_start + _up(table.size)
    i_start = p_start + _up(p_n * p_dt.itemsize)
    if i_start > size:
        raise WireError("malformed", f"sample table and prompt need {i_start} bytes, the message has {size}")
    values = table.unpack_from(mv, data_start)
    lengths = values[:n]
    offsets = list(itertools.accumulate(lengths, initial=0))
    total = offsets[-1]
    counts = values[5 * n :]
    if routing is not None:  # the routing rows end the frame: the other regions end where they begin
        size -= _routing.region_bytes(routing, n, p_n, sum(lengths))
        if size < i_start:
            raise WireError("malformed", f"message is {mv.nbytes} bytes, too short for its routing rows")
        full, mv = mv, mv[:size]
    span_offsets = list(itertools.accumulate(counts, initial=0))
    n_spans = span_offsets[-1]
    l_start = i_start + _up(total * i_dt.itemsize)
    s_start = l_start + _up(total * l_dt.itemsize)
    end = s_start + n_spans * _SPAN_BYTES
    if (end > size) if turns else (end != size):  # (plain int arithmetic: nothing was allocated for what the table claims)
        raise WireError("malformed", f"message is {size} bytes, but its header and sample table describe {end}")
    # Alignment padding must be zero: a header that under-states a length by a few elements would otherwise
    # still describe a frame of the right size, and silently cut the prompt (or a response) short.
    pads = ((_header_end(mv), data_start), (data_start + table.size, p_start),
            (p_start + p_n * p_dt.itemsize, i_start), (i_start + total * i_dt.itemsize, l_start),
            (l_start + total * l_dt.itemsize, s_start))
    if any(b > a and mv[a:b] != _ZEROS[: b - a] for a, b in pads):
        raise WireError("malformed", "alignment padding is not zero (a declared length is short of the data)")
    if n_spans > total + n:  # each sample has at most max(T, 1) spans
        raise WireError("schema", f"span counts {list(counts)} add up to {n_spans} > tokens + samples = {total + n}")
    flags = values[4 * n : 5 * n]
    if max(flags) > 3:
        raise WireError("schema", f"sample flags {list(flags)}: only bits 0 (length) and 1 (reward_failed) exist")
    vmin, vmax = values[2 * n : 3 * n], values[3 * n : 4 * n]
    spans = np.frombuffer(mv, dtype=_I8, count=2 * n_spans, offset=s_start).reshape(n_spans, 2)
    _check_spans(spans, counts, lengths, vmin, vmax, span_offsets)
    columns = SampleColumns(
        np.frombuffer(mv, dtype=i_dt, count=total, offset=i_start),
        np.frombuffer(mv, dtype=l_dt, count=total, offset=l_start),
        offsets,
        values[n : 2 * n],
        list(map(_FINISH_BY_FLAGS.__getitem__, flags)),
        vmin,
        vmax,
        list(map(_FAILED_BY_FLAGS.__getitem__, flags)),
        spans,
        span_offsets,
        read_turn_region(mv, end, n, lengths) if turns else None,
    )
    return TrajectoryGroup.from_columns(
        group_id, worker_id, np.frombuffer(mv, dtype=p_dt, count=p_n, offset=p_start), columns,
        prompt_index, ticket, answer, timings,
        None if routing is None else _routing.read_region(full, routing, n, p_n, offsets[-1]),
    )
