"""Wire format for trajectory groups and small control messages.

Why this layout
---------------
A trajectory group is a few scalars per sample plus a few large token arrays. Shipping the arrays through a
generic serialiser (pickle, msgpack ``bin`` fields) copies them several times and, for pickle, lets a peer run
code in the learner. Measured on this machine, multipart ZeroMQ messages (one frame per array) cost more per
message than the bytes they save. So a group travels as **one frame**::

    b"APPO" | uint32 LE header length | msgpack header | zero padding to 8 | array regions (each 8-aligned)

The msgpack header carries the schema version, the per-group and per-sample scalars (as short columns, so
validation is a handful of list checks rather than one dict per sample), and for each array region its dtype
string, shape and byte offset. The sender concatenates all response ids into one region and all behaviour
log-probs into another (it has to copy them into the frame anyway); the receiver takes zero-copy
``np.frombuffer`` views of the frame and slices them per sample. Decoded arrays are therefore **read-only views**
that keep the received frame alive; copy them (``np.array(x)``) before writing into them.

Nothing here trusts the peer: :func:`decode_group` checks the type of every field, the dtype whitelist, that
every region lies inside the frame and matches its shape, that per-sample lengths add up, and the schema
version, and raises :class:`WireError` with a short reason code:

* ``malformed`` - not parseable: bad magic, bad msgpack, regions outside the frame or of the wrong byte length;
* ``oversized`` - longer than the receiver's limit (checked before anything is parsed);
* ``version``   - a schema version other than :data:`SCHEMA_VERSION`;
* ``schema``    - parseable, but a field is missing, of the wrong type or has a disallowed value.

Small control messages (:func:`encode_message` / :func:`decode_message`) are plain msgpack maps with the same
schema-version field, validated against a caller-supplied field specification.
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

import msgpack
import numpy as np

from asyncppo.stream.records import Sample, TrajectoryGroup

SCHEMA_VERSION = 1
MAGIC = b"APPO"
_PREFIX = struct.Struct("<4sI")
_ALIGN = 8

#: Reason codes carried by :class:`WireError`.
REASONS = ("malformed", "oversized", "version", "schema")

FINISH_REASONS = ("stop", "length")

#: dtype strings allowed per array region. Little-endian only: the format is defined as little-endian and
#: we never byte-swap silently (a swap would break the bit-exact round trip promise).
ALLOWED_DTYPES: dict[str, tuple[str, ...]] = {
    "prompt_ids": ("<i4", "<i8"),
    "response_ids": ("<i4", "<i8"),
    "behavior_logprobs": ("<f4", "<f8", "<f2"),
}
_ARRAYS = tuple(ALLOWED_DTYPES)
_DTYPE_BY_STR = {d: np.dtype(d) for v in ALLOWED_DTYPES.values() for d in v}

# Header fields and the exact Python types msgpack decodes them to (bool is not accepted where int is wanted).
_GROUP_FIELDS: dict[str, type] = {
    "schema": int,
    "kind": str,
    "group_id": str,
    "worker_id": int,
    "prompt_index": int,
    "ticket": int,
    "answer": str,
    "timings": dict,
    "n": int,
    "lengths": list,
    "reward": list,
    "finish_reason": list,
    "version_min": list,
    "version_max": list,
    "reward_failed": list,
    "arrays": dict,
}
_COLUMN_TYPES: dict[str, frozenset] = {
    "lengths": frozenset({int}),
    "reward": frozenset({float}),
    "finish_reason": frozenset({str}),
    "version_min": frozenset({int}),
    "version_max": frozenset({int}),
    "reward_failed": frozenset({bool}),
}


class WireError(ValueError):
    """A message that must be rejected. ``reason`` is one of :data:`REASONS`; ``detail`` says what and why."""

    def __init__(self, reason: str, detail: str = ""):
        if reason not in REASONS:
            raise ValueError(f"unknown WireError reason {reason!r}; allowed: {REASONS}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def _dtype_str(arr: np.ndarray) -> str:
    return arr.dtype.str  # e.g. "<i4"; "|i1" for single bytes (not whitelisted)


# --------------------------------------------------------------------------------------------- encode


_DTYPE_OBJS: dict[str, frozenset] = {k: frozenset(np.dtype(d) for d in v) for k, v in ALLOWED_DTYPES.items()}
_ZEROS = b"\0" * _ALIGN


def _bad_array(name: str, arr: Any, where: str) -> WireError:
    """The precise complaint about an array that failed the fast check in :func:`encode_group`."""
    if not isinstance(arr, np.ndarray):
        return WireError("schema", f"{where}{name} must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != 1:
        return WireError("schema", f"{where}{name} must be 1-D, got shape {arr.shape}")
    return WireError("schema", f"{where}{name} has dtype {arr.dtype.str}; allowed: {ALLOWED_DTYPES[name]}")


def _contig(arr: np.ndarray) -> memoryview:
    return arr.data if arr.flags.c_contiguous else np.ascontiguousarray(arr).data


def encode_group(group: TrajectoryGroup) -> bytes:
    """Serialise ``group`` into one frame (see module docstring). Raises :class:`WireError` ("schema") when the
    group cannot be represented exactly (wrong or mixed dtypes, length mismatch, bad finish_reason, ...).

    Written as one flat loop because at realistic sizes the Python bookkeeping, not the byte copy, is the cost."""
    samples = group.samples
    n = len(samples)
    if n == 0:
        raise WireError("schema", "a group needs at least one sample")
    prompt = group.prompt_ids
    if type(prompt) is not np.ndarray or prompt.ndim != 1 or prompt.dtype not in _DTYPE_OBJS["prompt_ids"]:
        raise _bad_array("prompt_ids", prompt, "")
    ids_dt = lp_dt = None
    id_views: list[memoryview] = []
    lp_views: list[memoryview] = []
    lengths: list[int] = []
    rewards: list[float] = []
    finish: list[str] = []
    vmin: list[int] = []
    vmax: list[int] = []
    failed: list[bool] = []
    for j, s in enumerate(samples):
        a, b = s.response_ids, s.behavior_logprobs
        if type(a) is not np.ndarray or a.ndim != 1 or a.dtype not in _DTYPE_OBJS["response_ids"]:
            raise _bad_array("response_ids", a, f"samples[{j}].")
        if type(b) is not np.ndarray or b.ndim != 1 or b.dtype not in _DTYPE_OBJS["behavior_logprobs"]:
            raise _bad_array("behavior_logprobs", b, f"samples[{j}].")
        if ids_dt is None:
            ids_dt, lp_dt = a.dtype, b.dtype
        elif a.dtype != ids_dt or b.dtype != lp_dt:
            raise WireError("schema", f"samples[{j}]: all samples of a group must share dtypes ({ids_dt}, {lp_dt})")
        t = a.shape[0]
        if t != b.shape[0]:
            raise WireError("schema", f"samples[{j}]: len(response_ids)={t} != len(behavior_logprobs)={b.shape[0]}")
        if s.finish_reason not in FINISH_REASONS:
            raise WireError("schema", f"samples[{j}].finish_reason={s.finish_reason!r}; allowed: {FINISH_REASONS}")
        lengths.append(t)
        id_views.append(_contig(a))
        lp_views.append(_contig(b))
        rewards.append(float(s.reward))
        finish.append(s.finish_reason)
        vmin.append(int(s.version_min))
        vmax.append(int(s.version_max))
        failed.append(bool(s.reward_failed))
    total = sum(lengths)

    # Regions: prompt | all response ids | all logprobs, each starting 8-aligned relative to the data start.
    p_bytes = prompt.nbytes
    r_off = p_bytes + _pad(p_bytes)
    r_bytes = total * ids_dt.itemsize
    l_off = r_off + r_bytes + _pad(r_bytes)
    header = {
        "schema": SCHEMA_VERSION,
        "kind": "group",
        "group_id": str(group.group_id),
        "worker_id": int(group.worker_id),
        "prompt_index": int(group.prompt_index),
        "ticket": int(group.ticket),
        "answer": str(group.answer),
        "timings": {str(k): float(v) for k, v in group.timings.items()},
        "n": n,
        "lengths": lengths,
        "reward": rewards,
        "finish_reason": finish,
        "version_min": vmin,
        "version_max": vmax,
        "reward_failed": failed,
        "arrays": {
            "prompt_ids": [prompt.dtype.str, [prompt.shape[0]], 0],
            "response_ids": [ids_dt.str, [total], r_off],
            "behavior_logprobs": [lp_dt.str, [total], l_off],
        },
    }
    hdr = msgpack.packb(header, use_bin_type=True)
    head_len = _PREFIX.size + len(hdr)
    parts: list[Any] = [_PREFIX.pack(MAGIC, len(hdr)), hdr, _ZEROS[: _pad(head_len)], _contig(prompt), _ZEROS[: _pad(p_bytes)]]
    parts += id_views
    parts.append(_ZEROS[: _pad(r_bytes)])
    parts += lp_views
    return b"".join(parts)


# --------------------------------------------------------------------------------------------- decode


def _as_view(buf: Any) -> memoryview:
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise WireError("malformed", f"not a bytes-like object: {type(buf).__name__}") from e
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


def _unpack_header(mv: memoryview, max_bytes: int | None) -> tuple[dict, int]:
    size = mv.nbytes
    if max_bytes is not None and size > max_bytes:
        raise WireError("oversized", f"{size} bytes > limit {max_bytes}")
    if size < _PREFIX.size:
        raise WireError("malformed", f"{size} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, hlen = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise WireError("malformed", f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    end = _PREFIX.size + hlen
    if end > size:
        raise WireError("malformed", f"header length {hlen} runs past the end of a {size}-byte message")
    try:
        header = msgpack.unpackb(mv[_PREFIX.size : end], raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise WireError("malformed", f"header is not valid msgpack ({type(e).__name__})") from e
    if not isinstance(header, dict):
        raise WireError("schema", f"header must be a map, got {type(header).__name__}")
    return header, end + _pad(end)


def _check_fields(obj: Mapping, spec: Mapping[str, type], what: str) -> None:
    for key, typ in spec.items():
        if key not in obj:
            raise WireError("schema", f"{what}: missing field {key!r}")
        val = obj[key]
        if type(val) is not typ:
            raise WireError("schema", f"{what}: field {key!r} must be {typ.__name__}, got {type(val).__name__}")
    if len(obj) != len(spec):
        extra = sorted(str(k) for k in obj if k not in spec)
        raise WireError("schema", f"{what}: unexpected fields {extra}")


def _region(mv: memoryview, data_start: int, arrays: dict, name: str) -> np.ndarray:
    desc = arrays.get(name)
    if type(desc) is not list or len(desc) != 3:
        raise WireError("schema", f"arrays[{name!r}] must be [dtype, shape, offset]")
    dt, shape, off = desc
    if type(dt) is not str or dt not in ALLOWED_DTYPES[name]:
        raise WireError("schema", f"arrays[{name!r}] dtype {dt!r} not allowed; allowed: {ALLOWED_DTYPES[name]}")
    if type(shape) is not list or len(shape) != 1 or type(shape[0]) is not int or shape[0] < 0:
        raise WireError("schema", f"arrays[{name!r}] shape {shape!r} must be [length >= 0]")
    if type(off) is not int or off < 0 or off % _ALIGN:
        raise WireError("schema", f"arrays[{name!r}] offset {off!r} must be a non-negative multiple of {_ALIGN}")
    dtype = _DTYPE_BY_STR[dt]
    start = data_start + off
    stop = start + shape[0] * dtype.itemsize
    if stop > mv.nbytes:
        raise WireError("malformed", f"arrays[{name!r}] needs bytes [{start}, {stop}) of a {mv.nbytes}-byte message")
    return np.frombuffer(mv, dtype=dtype, count=shape[0], offset=start)


def decode_group(buf: Any, max_bytes: int | None = None) -> TrajectoryGroup:
    """Parse and validate one frame produced by :func:`encode_group`; raise :class:`WireError` on anything else.

    The returned arrays are read-only views into ``buf`` (zero copy)."""
    mv = _as_view(buf)
    header, data_start = _unpack_header(mv, max_bytes)
    schema = header.get("schema")
    if type(schema) is not int:
        raise WireError("schema", f"field 'schema' must be int, got {type(schema).__name__}")
    if schema != SCHEMA_VERSION:
        raise WireError("version", f"schema version {schema}, this reader speaks {SCHEMA_VERSION}")
    _check_fields(header, _GROUP_FIELDS, "group")
    if header["kind"] != "group":
        raise WireError("schema", f"kind {header['kind']!r}, expected 'group'")
    n = header["n"]
    if n < 1:
        raise WireError("schema", f"n={n}: a group needs at least one sample")
    for col, typ in _COLUMN_TYPES.items():
        values = header[col]
        if len(values) != n:
            raise WireError("schema", f"column {col!r} has {len(values)} entries, expected n={n}")
        if not set(map(type, values)) <= typ:  # exact types: bool is not accepted as int
            bad = next(v for v in values if type(v) not in typ)
            raise WireError("schema", f"column {col!r} entry {bad!r} must be {next(iter(typ)).__name__}")
    for fr in header["finish_reason"]:
        if fr not in FINISH_REASONS:
            raise WireError("schema", f"finish_reason {fr!r} not allowed; allowed: {FINISH_REASONS}")
    lengths = header["lengths"]
    if min(lengths) < 0:
        raise WireError("schema", f"negative response length in {lengths}")
    timings = header["timings"]
    for k, v in timings.items():
        if type(k) is not str or type(v) is not float:
            raise WireError("schema", f"timings entry {k!r}: {v!r} must be str -> float")
    arrays = header["arrays"]
    if len(arrays) != len(_ARRAYS):
        raise WireError("schema", f"arrays must be exactly {_ARRAYS}, got {sorted(map(str, arrays))}")
    prompt = _region(mv, data_start, arrays, "prompt_ids")
    ids = _region(mv, data_start, arrays, "response_ids")
    lps = _region(mv, data_start, arrays, "behavior_logprobs")
    total = sum(lengths)
    if ids.shape[0] != total or lps.shape[0] != total:
        raise WireError(
            "schema",
            f"sum(lengths)={total} but response_ids has {ids.shape[0]} and behavior_logprobs {lps.shape[0]} entries",
        )
    # The message must end exactly where the last region does: trailing bytes mean a confused encoder.
    expected_end = data_start + arrays["behavior_logprobs"][2] + lps.nbytes
    if mv.nbytes != expected_end:
        raise WireError("malformed", f"message is {mv.nbytes} bytes, regions end at {expected_end}")

    rewards, finish, vmin, vmax, failed = (
        header["reward"],
        header["finish_reason"],
        header["version_min"],
        header["version_max"],
        header["reward_failed"],
    )
    samples = []
    pos = 0
    for j in range(n):
        end = pos + lengths[j]
        samples.append(
            Sample(
                response_ids=ids[pos:end],
                behavior_logprobs=lps[pos:end],
                reward=rewards[j],
                finish_reason=finish[j],
                version_min=vmin[j],
                version_max=vmax[j],
                reward_failed=failed[j],
            )
        )
        pos = end
    return TrajectoryGroup(
        group_id=header["group_id"],
        worker_id=header["worker_id"],
        prompt_ids=prompt,
        samples=samples,
        prompt_index=header["prompt_index"],
        ticket=header["ticket"],
        answer=header["answer"],
        timings=timings,
    )


# --------------------------------------------------------------------------------------------- small messages


def encode_message(kind: str, **fields: Any) -> bytes:
    """A small control message: a msgpack map with the schema version and ``kind``. Values must be msgpack-native."""
    return msgpack.packb({"schema": SCHEMA_VERSION, "kind": kind, **fields}, use_bin_type=True)


def decode_message(
    buf: Any, spec: Mapping[str, Mapping[str, type]], max_bytes: int = 65536
) -> tuple[str, dict[str, Any]]:
    """Validate a message from :func:`encode_message` against ``spec`` (kind -> {field: exact type}).

    Returns ``(kind, fields)`` without the ``schema``/``kind`` keys, or raises :class:`WireError`."""
    mv = _as_view(buf)
    if mv.nbytes > max_bytes:
        raise WireError("oversized", f"{mv.nbytes} bytes > limit {max_bytes}")
    try:
        msg = msgpack.unpackb(mv, raw=False, strict_map_key=True)
    except Exception as e:
        raise WireError("malformed", f"not valid msgpack ({type(e).__name__})") from e
    if not isinstance(msg, dict):
        raise WireError("schema", f"message must be a map, got {type(msg).__name__}")
    schema = msg.get("schema")
    if type(schema) is not int:
        raise WireError("schema", "field 'schema' must be int")
    if schema != SCHEMA_VERSION:
        raise WireError("version", f"schema version {schema}, this reader speaks {SCHEMA_VERSION}")
    kind = msg.get("kind")
    if type(kind) is not str or kind not in spec:
        raise WireError("schema", f"kind {kind!r} not allowed; allowed: {sorted(spec)}")
    fields = {k: v for k, v in msg.items() if k not in ("schema", "kind")}
    _check_fields(fields, spec[kind], kind)
    return kind, fields
