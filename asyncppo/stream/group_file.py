"""Trajectory groups kept in a file: the wire frames of :mod:`asyncppo.stream.wire`, each behind its byte length.

Why a file: the pipeline's limit (docs/benchmarks.md) measures the engine alone and the learner alone in separate
processes, one after the other, and the learner must train exactly the groups the engine generated. A run with
``trainer.save_trained_groups`` appends every group it trains to ``trained_groups.bin`` the same way, so its own
batches can be replayed through the learner alone. The frames are the ones the socket carries, decoded with every
check the door relies on; nothing is pickled.
"""

from __future__ import annotations

import struct

from asyncppo.stream.records import TrajectoryGroup
from asyncppo.stream.wire import decode_group, encode_group

_LENGTH = struct.Struct("<Q")


def write_groups(path: str, groups: list[TrajectoryGroup], *, append: bool = False) -> None:
    """Write ``groups`` to ``path`` (``append``: after what it already holds)."""
    with open(path, "ab" if append else "wb") as f:
        for group in groups:
            frame = encode_group(group)
            f.write(_LENGTH.pack(len(frame)))
            f.write(frame)


def read_groups(path: str) -> list[TrajectoryGroup]:
    """Every group written by :func:`write_groups`; a truncated file is an error naming the path and offset."""
    with open(path, "rb") as f:
        data = f.read()
    groups, at = [], 0
    while at < len(data):
        if at + _LENGTH.size > len(data):
            raise ValueError(f"{path}: truncated length at byte {at}")
        (size,) = _LENGTH.unpack_from(data, at)
        at += _LENGTH.size
        if at + size > len(data):
            raise ValueError(f"{path}: frame at byte {at} needs {size} bytes, {len(data) - at} left")
        groups.append(decode_group(bytes(data[at:at + size])))
        at += size
    return groups
