"""The data position of a run: which draws of each rollout worker's prompt sequence the learner has trained.

Why. A worker draws prompts from a deterministic endless sequence (its shard, reshuffled per epoch from a seed):
draw number ``seq`` is always the same prompt, and its sampling seed derives from ``seq`` too. Group ids carry the
draw number (``"<worker>-<seq>"``, or ``"<worker>.<incarnation>-<seq>"`` for a restarted worker), so the learner
can record, per worker, the lowest draw not yet trained (``next``) and the trained draws above it (``done``). A
checkpoint stores that; a resumed run, or a replacement of a worker that died, starts the sequence at ``next`` and
skips ``done``: every prompt drawn but never trained (in flight when the process died) is drawn again, and nothing
trained is drawn twice. With one worker and ``max_staleness = 0`` the trained draws are always a prefix, so a
resumed run trains exactly the prompt sequence of a run that never stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any, Optional

from asyncppo.stream.group_ids import parse_key

_MAX_DONE = 100_000  # a draw that is never trained (a dropped group) would pin `next`: past this, skip the gap


class DataPosition:
    """Per worker: the lowest untrained draw and the trained draws above it. Thread-safe."""

    def __init__(self, state: Optional[dict] = None):
        self._lock = threading.Lock()
        self._next: dict[int, int] = {}
        self._done: dict[int, set[int]] = {}
        for w, pos in (state or {}).items():
            self._next[int(w)] = int(pos["next"])
            self._done[int(w)] = {int(s) for s in pos["done"]}

    def record(self, group_id: str) -> None:
        parsed = parse_key(group_id)
        if parsed is None:
            return
        worker, seq = parsed
        with self._lock:
            nxt = self._next.setdefault(worker, 0)
            done = self._done.setdefault(worker, set())
            if seq < nxt:
                return
            done.add(seq)
            while nxt in done:
                done.remove(nxt)
                nxt += 1
            if len(done) > _MAX_DONE:
                nxt = min(done)
                while nxt in done:
                    done.remove(nxt)
                    nxt += 1
            self._next[worker] = nxt

    def of(self, worker_id: int) -> dict[str, Any]:
        with self._lock:
            return {"next": self._next.get(worker_id, 0), "done": sorted(self._done.get(worker_id, ()))}

    def state_dict(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            workers = sorted(set(self._next) | set(self._done))
        return {w: self.of(w) for w in workers}


def resume_draws(draws: Iterable, position: Optional[dict] = None) -> Iterator[tuple[int, Any]]:
    """``(seq, item)`` pairs of the endless sequence ``draws``, starting at ``position["next"]`` and skipping the
    draws in ``position["done"]`` (a worker's :meth:`DataPosition.of`)."""
    start = int(position["next"]) if position else 0
    skip = {int(s) for s in position["done"]} if position else set()
    for seq, item in enumerate(draws):
        if seq >= start and seq not in skip:
            yield seq, item
