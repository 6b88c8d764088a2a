"""A sequence's routing record: the experts chosen at each of its positions, as the engines build it (docs/moe.md).

One rule for every writer (the transformers engine's steps, vLLM's capture, a multi-turn episode's turns): a
position keeps its **first** record. A position computed again (a re-prefill after a weight push, the transformers
engine's ``kv_cache=False`` re-running every prefix, a later turn's request over the whole prefix) does not
overwrite the choice its next token was sampled from, which is also the version the learner labels it with. Records
are int16 ``[positions, layers, top_k]`` with -1 where no forward ran; they grow by doubling, so a sequence costs
its own length, not the engine's longest.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def record_first(rec: Optional[np.ndarray], start: int, chosen: np.ndarray,
                 limit: Optional[int] = None) -> np.ndarray:
    """``rec`` (None: a new record) with ``chosen`` ``[n, layers, top_k]`` written at positions ``start...`` where
    none is recorded yet, grown as needed (to at most ``limit`` positions; what lies past it is dropped)."""
    end = start + chosen.shape[0] if limit is None else min(start + chosen.shape[0], limit)
    if rec is None or rec.shape[0] < end:
        size = max(end, 64, 0 if rec is None else 2 * rec.shape[0])
        grown = np.full((size if limit is None else min(size, limit), *chosen.shape[1:]), -1, np.int16)
        if rec is not None:
            grown[: rec.shape[0]] = rec
        rec = grown
    if end > start:
        seg = rec[start:end]
        unrecorded = (seg < 0).all(axis=(1, 2))
        seg[unrecorded] = chosen[: end - start][unrecorded]
    return rec


def finished(rec: Optional[np.ndarray], positions: int, shape: tuple[int, int]) -> np.ndarray:
    """The record of a finished sequence of ``positions`` positions: ``rec``'s rows, -1 past them and at the last
    position (the last sampled token never ran through the model)."""
    out = np.full((positions, *shape), -1, np.int16)
    if rec is not None:
        kept = min(positions, rec.shape[0])
        out[:kept] = rec[:kept]
    out[positions - 1 :] = -1
    return out
