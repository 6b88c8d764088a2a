"""Trajectory groups kept in a file: the wire frames of :mod:`asyncppo.stream.wire`, each behind its byte length.

Why a file: the pipeline's limit (docs/benchmarks.md) measures the engine alone and the learner alone in separate
processes, one after the other, and the learner must train exactly the groups the engine generated. The frames are
the ones the socket carries, decoded with every check the door relies on; nothing is pickled.
"""

from __future__ import annotations

import struct

from asyncppo.stream.records import TrajectoryGroup
from asyncppo.stream.wire import decode_group, encode_group

_LENGTH = struct.Struct("<Q")


def write_groups(path: str, groups: list[TrajectoryGroup]) -> None:
    with open(path, "wb") as f:
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
