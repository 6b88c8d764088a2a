"""Group ids: ``"<worker>-<draw>"``, or ``"<worker>.<incarnation>-<draw>"`` for a restarted worker.

Why a format and not any string: the id names the draw of the worker's prompt sequence the group came from, which
the learner records as its data position (asyncppo/data/position.py) and a resumed run or a replaced worker starts
from. The learner's door therefore refuses a group whose id is not of this form or names another worker
(asyncppo/stream/validate.py): one taking another worker's next id would have that worker's real group refused as a
duplicate, its ticket stuck.
"""

from __future__ import annotations

import re
from typing import Optional


def group_key(worker_id: int, incarnation: int, seq: int) -> str:
    """The group id of draw ``seq`` by worker ``worker_id`` in its ``incarnation``-th process (0: the first)."""
    return f"{worker_id}-{seq}" if incarnation == 0 else f"{worker_id}.{incarnation}-{seq}"


#: What :func:`group_key` makes: ASCII digits only (``str.isdigit`` also takes "²", which ``int`` refuses) and a
#: bounded count of them (a peer's 5,000-digit draw number must not reach ``int``'s digit limit or the position).
_KEY = re.compile(r"([0-9]{1,9})(?:\.[0-9]{1,9})?-([0-9]{1,18})")


def parse_key(group_id: str) -> Optional[tuple[int, int]]:
    """``(worker_id, seq)`` of a group id made by :func:`group_key`, None for any other string (never raises: the
    id comes from a peer)."""
    m = _KEY.fullmatch(group_id) if isinstance(group_id, str) else None
    return None if m is None else (int(m.group(1)), int(m.group(2)))
