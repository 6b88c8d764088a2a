"""The one msgpack framing of the package: every message that crosses a socket is built and parsed here.

Why one module
--------------
Trajectory groups (:mod:`asyncppo.stream.wire`), transition segments (:mod:`asyncppo.stream.segments`), evaluation
reports (:mod:`asyncppo.stream.evals`) and the small control / ticket messages all carry a msgpack part, and the
two array-carrying formats share one frame shape. Each used to spell the msgpack options, the prefix parse and the
bounds checks itself; a difference between those copies is exactly where a hostile peer gets in. So the rules live
once, here:

* msgpack only, never pickle: a peer's bytes can describe data, never code;
* strings are decoded as UTF-8 (``raw=False``), map keys must be str or bytes (``strict_map_key=True``), binary
  stays ``bin`` (``use_bin_type=True``);
* an array-carrying frame is ``magic (4 bytes) | uint32 LE header length | msgpack header | zero pad to 8 | raw
  little-endian array regions, each padded to 8``; the header describes the regions, so a reader computes the
  exact frame length before it allocates anything;
* a small message is a msgpack map with ``schema`` and ``kind`` fields, checked against an exact field
  specification (:func:`decode_message`).

Every failure is a :class:`~asyncppo.stream.errors.WireError` with a reason code (``malformed``, ``oversized``,
``version``, ``schema``), which receivers count and drop.
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

import msgpack

from asyncppo.stream.errors import WireError

PREFIX = struct.Struct("<4sI")
ALIGN = 8
ZEROS = b"\0" * ALIGN
#: Schema version of the small control / ticket messages (it began as the group frame's version and moves with it).
MESSAGE_SCHEMA = 3


def pad(n: int) -> int:
    """Bytes of zero padding after ``n`` bytes to reach the next 8-byte boundary."""
    return (-n) % ALIGN


def up(n: int) -> int:
    """``n`` rounded up to the next 8-byte boundary."""
    return n + (-n) % ALIGN


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (msgpack-native values only; TypeError/ValueError/OverflowError otherwise)."""
    return msgpack.packb(obj, use_bin_type=True)


#: A frame's msgpack header describes its array regions and a few scalars (ids, an answer string, a few dozen
#: timings): far below these. Without them a header was bounded only by the frame limit (256 MiB), and a peer's
#: header of nested empty arrays, one byte each, unpacked to ~70x its size before any field was checked.
MAX_HEADER_BYTES = 1 << 20
MAX_HEADER_ITEMS = 4096  # entries of any one array or map in a header


def unpack(data: Any, what: str = "message", max_items: int | None = None) -> Any:
    """The object in msgpack ``data``; WireError("malformed") naming the msgpack error when it is not valid.
    ``max_items``: refuse any array or map with more entries."""
    limits = {} if max_items is None else {"max_array_len": max_items, "max_map_len": max_items}
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **limits)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise WireError("malformed", f"{what} is not valid msgpack ({type(e).__name__})") from e


def as_view(buf: Any) -> memoryview:
    """A flat byte view of ``buf`` (no copy); WireError("malformed") when it is not bytes-like."""
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise WireError("malformed", f"not a bytes-like object: {type(buf).__name__}") from e
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


def header_parts(magic: bytes, header: Any) -> list[bytes]:
    """The start of a frame: prefix, msgpack ``header`` and the zero pad after it. Raises what :func:`pack`
    raises when the header holds a value msgpack cannot represent, and ValueError when it is longer than a
    receiver reads (``MAX_HEADER_BYTES``)."""
    hdr = pack(header)
    if len(hdr) > MAX_HEADER_BYTES:  # the receiver would refuse it unread: say so at the sender
        raise ValueError(f"a frame header of {len(hdr)} bytes > the limit {MAX_HEADER_BYTES}")
    return [PREFIX.pack(magic, len(hdr)), hdr, ZEROS[: pad(PREFIX.size + len(hdr))]]


def header_end(mv: memoryview) -> int:
    """Where the msgpack header of a frame ends (its prefix is already known to be valid)."""
    return PREFIX.size + PREFIX.unpack_from(mv, 0)[1]


def read_header(mv: memoryview, magic: bytes, max_bytes: int | None, what: str = "header",
                magic_note: str = "") -> tuple[Any, int]:
    """``(header, offset of the first array region)`` of a frame, after the size limit, the prefix, the magic
    and the header's bounds are checked. The header's type and fields are the caller's to check."""
    size = mv.nbytes
    if max_bytes is not None and size > max_bytes:
        raise WireError("oversized", f"{size} bytes > limit {max_bytes}")
    if size < PREFIX.size:
        raise WireError("malformed", f"{size} bytes is shorter than the {PREFIX.size}-byte prefix")
    got, hlen = PREFIX.unpack_from(mv, 0)
    if got != magic:
        raise WireError("malformed", f"bad magic {bytes(got)!r}, expected {magic!r}{magic_note}")
    end = PREFIX.size + hlen
    if end > size:
        raise WireError("malformed", f"header length {hlen} runs past the end of a {size}-byte message")
    if hlen > MAX_HEADER_BYTES:
        raise WireError("oversized", f"{what} of {hlen} bytes > limit {MAX_HEADER_BYTES}")
    return unpack(mv[PREFIX.size : end], what, MAX_HEADER_ITEMS), end + pad(end)


#: Every int field of a small message lies within +-2**53: indices, versions and counts never come near it, and a
#: peer's 2**64 - 1 would overflow where the value is used or sent back (a reply echoing it could not be encoded).
MAX_FIELD_INT = 1 << 53


def check_fields(obj: Mapping, spec: Mapping[str, type], what: str) -> None:
    """Every field of ``spec`` present with exactly its type (bool is not int), ints within ``MAX_FIELD_INT``, and
    no other field."""
    for key, typ in spec.items():
        if key not in obj:
            raise WireError("schema", f"{what}: missing field {key!r}")
        val = obj[key]
        if type(val) is not typ:
            raise WireError("schema", f"{what}: field {key!r} must be {typ.__name__}, got {type(val).__name__}")
        if typ is int and not -MAX_FIELD_INT <= val <= MAX_FIELD_INT:
            raise WireError("schema", f"{what}: field {key!r} = {val} is outside +-2**53")
    if len(obj) != len(spec):
        extra = sorted(str(k) for k in obj if k not in spec)
        raise WireError("schema", f"{what}: unexpected fields {extra}")


def encode_message(kind: str, **fields: Any) -> bytes:
    """A small control message: a msgpack map with the schema version and ``kind``. Values must be msgpack-native."""
    return pack({"schema": MESSAGE_SCHEMA, "kind": kind, **fields})


def decode_message(
    buf: Any, spec: Mapping[str, Mapping[str, type]], max_bytes: int = 65536
) -> tuple[str, dict[str, Any]]:
    """Validate a message from :func:`encode_message` against ``spec`` (kind -> {field: exact type}).

    Returns ``(kind, fields)`` without the ``schema``/``kind`` keys, or raises :class:`WireError`."""
    mv = as_view(buf)
    if mv.nbytes > max_bytes:
        raise WireError("oversized", f"{mv.nbytes} bytes > limit {max_bytes}")
    msg = unpack(mv, "message")
    if not isinstance(msg, dict):
        raise WireError("schema", f"message must be a map, got {type(msg).__name__}")
    schema = msg.get("schema")
    if type(schema) is not int:
        raise WireError("schema", "field 'schema' must be int")
    if schema != MESSAGE_SCHEMA:
        raise WireError("version", f"schema version {schema}, this reader speaks {MESSAGE_SCHEMA}")
    kind = msg.get("kind")
    if type(kind) is not str or kind not in spec:
        raise WireError("schema", f"kind {kind!r} not allowed; allowed: {sorted(spec)}")
    fields = {k: v for k, v in msg.items() if k not in ("schema", "kind")}
    check_fields(fields, spec[kind], kind)
    return kind, fields
