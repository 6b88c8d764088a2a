"""What travels in a weight push, and how tensors are laid out in buckets (pure functions, no communication).

A push is: a fixed 3-int64 preamble (magic, protocol, header length), a msgpack header (version, bucket size,
and ``[name, dtype, shape]`` per tensor), then the buckets. The bucket plan is *derived* from the header by the
same function on both sides, so the header carries no offsets that could disagree with the data.

Buckets are flat byte buffers, filled in the order the sender was given the tensors. Why bytes rather than one
bucket per dtype: keeping the original order keeps each layer's tensors together, which the engine loader relies
on to load a complete layer per call (see :mod:`asyncppo.sync.engine_load`); mixed-dtype models still pack
densely. Offsets are aligned to :data:`ALIGN` so every slice can be viewed as its dtype. A tensor larger than the
bucket is sent alone in bucket-sized chunks, so no broadcast message ever exceeds ``bucket_bytes``.

The header is msgpack, never pickle: it arrives over a socket, and anything malformed is rejected with
:class:`WeightSyncProtocolError` naming the offending field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack
import torch

MAGIC = 0x41505053594E43  # "APPSYNC"
PROTOCOL = 1
ALIGN = 16  # bytes; covers every element size torch has (complex128 is 16)
MAX_HEADER_BYTES = 256 << 20

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WeightSyncProtocolError(ValueError):
    """A push header or bucket that does not follow the protocol (the group is out of step afterwards)."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Header:
    version: int
    bucket_bytes: int
    tensors: tuple[TensorMeta, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(m.nbytes for m in self.tensors)


@dataclass(frozen=True)
class Piece:
    """Bytes ``[src_start, src_start + nbytes)`` of tensor ``index`` sit at ``offset`` in their bucket."""

    index: int
    offset: int
    src_start: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    pieces: tuple[Piece, ...]
    complete: tuple[int, ...]  # tensors whose last byte arrives with this bucket
    chunk: bool  # one slice of a tensor larger than a bucket (received straight into the tensor)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise WeightSyncProtocolError(
            f"dtype {dtype} cannot be pushed; allowed: {', '.join(sorted(DTYPES))}") from None


def meta_of(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(int(d) for d in tensor.shape))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(metas: tuple[TensorMeta, ...] | list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Greedy, order-preserving packing: every bucket holds at most ``bucket_bytes`` bytes."""
    if bucket_bytes < ALIGN:
        raise WeightSyncProtocolError(f"bucket_bytes={bucket_bytes} must be >= {ALIGN}")
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    used = 0

    def flush() -> None:
        nonlocal pieces, used
        if pieces:
            buckets.append(Bucket(nbytes=used, pieces=tuple(pieces), complete=tuple(p.index for p in pieces),
                                  chunk=False))
        pieces, used = [], 0

    for i, m in enumerate(metas):
        n = m.nbytes
        if n > bucket_bytes:
            flush()
            for start in range(0, n, bucket_bytes):
                size = min(bucket_bytes, n - start)
                last = start + size == n
                buckets.append(Bucket(nbytes=size, pieces=(Piece(i, 0, start, size),),
                                      complete=(i,) if last else (), chunk=True))
            continue
        offset = _align(used)
        if pieces and offset + n > bucket_bytes:
            flush()
            offset = 0
        pieces.append(Piece(i, offset, 0, n))
        used = offset + n
    flush()
    return buckets


def encode_header(header: Header) -> bytes:
    return msgpack.packb(
        {"version": header.version, "bucket_bytes": header.bucket_bytes,
         "tensors": [[m.name, m.dtype, list(m.shape)] for m in header.tensors]},
        use_bin_type=True,
    )


def preamble(header_len: int) -> torch.Tensor:
    return torch.tensor([MAGIC, PROTOCOL, header_len], dtype=torch.int64)


def check_preamble(values: list[int]) -> int:
    """Validate the preamble; return the header length."""
    magic, protocol, length = values
    if magic != MAGIC:
        raise WeightSyncProtocolError(
            f"not a weight-sync push: magic {magic:#x} != {MAGIC:#x} (another program on the sync group?)")
    if protocol != PROTOCOL:
        raise WeightSyncProtocolError(f"protocol {protocol} from the sender; this receiver speaks {PROTOCOL}")
    if not 0 < length <= MAX_HEADER_BYTES:
        raise WeightSyncProtocolError(f"header length {length} outside (0, {MAX_HEADER_BYTES}]")
    return length


def decode_header(data: bytes) -> Header:
    """Parse and validate a header; every rejection names the field and what is allowed."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:
        raise WeightSyncProtocolError(f"header is not valid msgpack: {e}") from e
    if not isinstance(obj, dict):
        raise WeightSyncProtocolError(f"header must be a map, got {type(obj).__name__}")
    expected = {"version", "bucket_bytes", "tensors"}
    if set(obj) != expected:
        raise WeightSyncProtocolError(f"header keys {sorted(obj)} != {sorted(expected)}")
    version, bucket_bytes, tensors = obj["version"], obj["bucket_bytes"], obj["tensors"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise WeightSyncProtocolError(f"header 'version'={version!r}: must be an int >= 0")
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < ALIGN:
        raise WeightSyncProtocolError(f"header 'bucket_bytes'={bucket_bytes!r}: must be an int >= {ALIGN}")
    if not isinstance(tensors, list):
        raise WeightSyncProtocolError(f"header 'tensors' must be a list, got {type(tensors).__name__}")
    metas, seen = [], set()
    for k, entry in enumerate(tensors):
        if not (isinstance(entry, list) and len(entry) == 3):
            raise WeightSyncProtocolError(f"header 'tensors'[{k}]={entry!r}: must be [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(name, str) or not name:
            raise WeightSyncProtocolError(f"header 'tensors'[{k}] name={name!r}: must be a non-empty string")
        if name in seen:
            raise WeightSyncProtocolError(f"header 'tensors'[{k}] name={name!r} appears twice")
        if dtype not in DTYPES:
            raise WeightSyncProtocolError(
                f"header tensor {name!r} dtype={dtype!r}: allowed {', '.join(sorted(DTYPES))}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise WeightSyncProtocolError(f"header tensor {name!r} shape={shape!r}: must be a list of ints >= 0")
        seen.add(name)
        metas.append(TensorMeta(name=name, dtype=dtype, shape=tuple(shape)))
    return Header(version=version, bucket_bytes=bucket_bytes, tensors=tuple(metas))
