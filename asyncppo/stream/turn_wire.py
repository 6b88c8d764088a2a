"""The optional turn region of a group frame (:mod:`asyncppo.stream.wire`): environment segments and turn rewards.

Present only when the group has turn data (:mod:`asyncppo.stream.turns`); then the header carries a 14th field,
``turns`` (int, :data:`TURNS_FORMAT`), and the frame continues after the version spans with::

    n x uint32 segment count | n x uint32 turn-reward count | pad to 8
    | segments: rows of (int64 start, int64 length) | turn rewards: float64

all little-endian. A single-turn group has neither the field nor the region, so its frame is unchanged and a reader
of this version decodes old frames identically. As everywhere in the format, the exact frame length follows from
the header and the tables and is checked before any array is built; the turn rules (:func:`check_turns`) are then
checked and a break is a ``schema`` :class:`WireError`.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any, Optional

import numpy as np

from asyncppo.stream.errors import WireError
from asyncppo.stream.framing import ZEROS, pad, up
from asyncppo.stream.turns import TurnColumns, check_turns

#: The value of the header's ``turns`` field (the layout of the region above).
TURNS_FORMAT = 1
_I8, _F8 = np.dtype("<i8"), np.dtype("<f8")
_RUN_BYTES = 16


def group_turns(group: Any) -> Optional[TurnColumns]:
    """The group's turn columns (None for a single-turn group), without building columns for the rest."""
    try:
        return group.turn_columns()
    except ValueError as e:
        raise WireError("schema", str(e)) from None


def pop_turns_field(header: list, num_fields: int) -> bool:
    """Whether ``header`` (a group header of ``num_fields`` fields plus maybe the optional ``turns``) is a
    multi-turn group's; the field is removed when present, and a wrong value is a ``schema`` error."""
    if len(header) != num_fields + 1:
        return False
    if type(header[-1]) is not int or header[-1] != TURNS_FORMAT:
        raise WireError("schema", f"group: field 'turns' must be the int {TURNS_FORMAT}, got {header[-1]!r}")
    header.pop()
    return True


def turn_region(turns: TurnColumns, lengths: list) -> list:
    """The frame parts of the turn region, after checking the turn rules (a sender's bug is named at the sender)."""
    problem = check_turns(turns, lengths)
    if problem is not None:
        raise WireError("schema", f"turns: {problem}")
    n = len(lengths)
    table = struct.pack(f"<{n}I{n}I", *turns.run_counts(), *turns.reward_counts())
    runs = np.ascontiguousarray(turns.env_runs, dtype=_I8)
    rewards = np.ascontiguousarray(turns.turn_rewards, dtype=_F8)
    return [table, ZEROS[: pad(len(table))], runs, rewards]


def read_turn_region(mv: memoryview, start: int, n: int, lengths: list) -> TurnColumns:
    """Parse the turn region that begins at ``start`` and must end exactly where ``mv`` ends."""
    size = mv.nbytes
    if start == size:  # the header's 14th field alone: a header that does not match the frame's schema
        raise WireError("schema", "group: the header has a 'turns' field but the frame has no turn region")
    table = struct.Struct(f"<{n}I{n}I")
    data = start + up(table.size)
    if data > size:
        raise WireError("malformed", f"turn table needs {data} bytes, the message has {size}")
    values = table.unpack_from(mv, start)
    run_offsets = list(itertools.accumulate(values[:n], initial=0))
    reward_offsets = list(itertools.accumulate(values[n:], initial=0))
    n_runs, n_rewards = run_offsets[-1], reward_offsets[-1]
    end = data + n_runs * _RUN_BYTES + n_rewards * 8
    if end != size:
        raise WireError("malformed", f"message is {size} bytes, but its turn table describes {end}")
    if data > start + table.size and mv[start + table.size:data] != ZEROS[: data - start - table.size]:
        raise WireError("malformed", "alignment padding is not zero (a declared length is short of the data)")
    turns = TurnColumns(
        np.frombuffer(mv, dtype=_I8, count=2 * n_runs, offset=data).reshape(n_runs, 2), run_offsets,
        np.frombuffer(mv, dtype=_F8, count=n_rewards, offset=data + n_runs * _RUN_BYTES), reward_offsets,
    )
    problem = check_turns(turns, lengths)
    if problem is not None:
        raise WireError("schema", f"turns: {problem}")
    return turns
