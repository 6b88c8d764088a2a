"""The routing column of a group (mixture-of-experts policies): which experts the engine chose for every token.

What travels: for each sample, in order, one row per position of its sequence (the prompt's positions, then the
response's), each row ``layers x top_k`` expert ids, little-endian ``uint8`` (at most 255 experts) or ``uint16``.
:data:`NONE_U8` / :data:`NONE_U16` (the type's largest value) marks a position without a record: the last token of a
response, which the engine sampled but never ran through the model. Sample ``j`` owns rows
``[sum_{i<j} (P + T_i), sum_{i<=j} (P + T_i))`` for prompt length ``P`` and response lengths ``T_i``.

Cost: ``layers x top_k`` bytes a token at up to 255 experts. The built-in tiny MoE (2 layers, top-2) adds 4 bytes a
token to the ~12 the ids, log-probs and versions take; a 48-layer top-8 model of 128 experts adds 384.

In a frame (:mod:`asyncppo.stream.wire`) the column is optional: a group with one carries a last header field
``[layers, top_k, dtype]`` and its rows end the frame, after every other region. The decoder computes the region's
exact size from the header and the sample table before it reads anything, and :func:`content_problem` (the
learner's door) checks the ids against the model the learner trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from asyncppo.stream.errors import WireError

NONE_U8, NONE_U16 = 0xFF, 0xFFFF
DTYPES = {"|u1": np.dtype("u1"), "<u2": np.dtype("<u2")}
MAX_LAYERS, MAX_TOP_K = 1024, 64


@dataclass(frozen=True)
class RoutingColumn:
    """``experts``: ``[rows, layers, top_k]`` uint8 or uint16, the rows of every sample's sequence in order."""

    experts: np.ndarray

    @property
    def layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def none_value(self) -> int:
        return NONE_U8 if self.experts.dtype.itemsize == 1 else NONE_U16

    @classmethod
    def from_samples(cls, per_sample: list[np.ndarray], num_experts: int) -> "RoutingColumn":
        """The column of ``per_sample`` int arrays ``[P + T_j, layers, top_k]`` (-1: no record), in the narrowest
        type that holds ``num_experts`` ids and the no-record mark."""
        dtype = np.dtype("u1") if num_experts < NONE_U8 else np.dtype("<u2")
        none = NONE_U8 if dtype.itemsize == 1 else NONE_U16
        rows = np.concatenate(per_sample) if per_sample else np.zeros((0, 1, 1), np.int64)
        return cls(np.where(rows < 0, none, rows).astype(dtype))

    def per_sample(self, prompt_len: int, lengths: list[int]) -> list[np.ndarray]:
        """Each sample's rows, as int16 ``[P + T_j, layers, top_k]`` with -1 where there is no record."""
        out, start = [], 0
        for t in lengths:
            rows = self.experts[start : start + prompt_len + t]
            out.append(np.where(rows == self.none_value, -1, rows.astype(np.int16)).astype(np.int16))
            start += prompt_len + t
        return out


def expected_rows(prompt_len: int, lengths: list[int]) -> int:
    return len(lengths) * int(prompt_len) + int(sum(lengths))


def header_field(col: RoutingColumn, prompt_len: int, lengths: list[int]) -> list:
    """The frame's ``[layers, top_k, dtype]`` field, after checking the column fits the group (a sender's bug is
    named at the sender)."""
    e = col.experts
    if not isinstance(e, np.ndarray) or e.ndim != 3 or e.dtype.str not in DTYPES:
        what = f"{e.dtype}, shape {e.shape}" if isinstance(e, np.ndarray) else type(e).__name__
        raise WireError("schema", f"routing: experts must be a [rows, layers, top_k] uint8/uint16 array, got {what}")
    if not (1 <= e.shape[1] <= MAX_LAYERS and 1 <= e.shape[2] <= MAX_TOP_K):
        raise WireError("schema", f"routing: {e.shape[1]} layers x top-{e.shape[2]} outside 1..{MAX_LAYERS} x "
                                  f"1..{MAX_TOP_K}")
    rows = expected_rows(prompt_len, lengths)
    if e.shape[0] != rows:
        raise WireError("schema", f"routing: {e.shape[0]} rows for a group of {rows} positions (prompt x samples "
                                  "+ response tokens)")
    return [int(e.shape[1]), int(e.shape[2]), e.dtype.str]


def pop_field(header: list, base_fields: int) -> Optional[tuple[int, int, np.dtype]]:
    """The routing field of a group header (removed), or None when the group has no routing column. A field that
    is present but wrong is a ``schema`` error."""
    if len(header) <= base_fields or type(header[-1]) is not list:
        return None
    field = header.pop()
    if (len(field) != 3 or type(field[0]) is not int or type(field[1]) is not int or type(field[2]) is not str
            or field[2] not in DTYPES):
        raise WireError("schema", f"group: field 'routing' must be [layers, top_k, '|u1' or '<u2'], got {field!r}"[:200])
    layers, top_k = field[0], field[1]
    if not (1 <= layers <= MAX_LAYERS and 1 <= top_k <= MAX_TOP_K):
        raise WireError("schema", f"routing: {layers} layers x top-{top_k} outside 1..{MAX_LAYERS} x 1..{MAX_TOP_K}")
    return layers, top_k, DTYPES[field[2]]


def region_bytes(spec: tuple[int, int, np.dtype], n: int, prompt_len: int, total_tokens: int) -> int:
    layers, top_k, dtype = spec
    return (n * prompt_len + total_tokens) * layers * top_k * dtype.itemsize


def read_region(mv: memoryview, spec: tuple[int, int, np.dtype], n: int, prompt_len: int, total: int) -> RoutingColumn:
    """The column stored in the last :func:`region_bytes` of ``mv`` (the caller checked the frame holds them)."""
    layers, top_k, dtype = spec
    rows = n * prompt_len + total
    start = mv.nbytes - region_bytes(spec, n, prompt_len, total)
    data = np.frombuffer(mv, dtype=dtype, count=rows * layers * top_k, offset=start)
    return RoutingColumn(data.reshape(rows, layers, top_k))


def content_problem(col: Optional[RoutingColumn], expected: Optional[tuple[int, int, int]], prompt_len: int,
                    lengths: list[int]) -> Optional[str]:
    """What is wrong with a group's routing for a learner that expects ``(layers, top_k, num_experts)`` (None: a
    run without routing, which takes no column), or None."""
    if expected is None:
        return None if col is None else "a routing column in a run without routing replay"
    if col is None:
        return "no routing column; this run replays the engine's experts (algorithm.routing_replay)"
    layers, top_k, experts = expected
    if (col.layers, col.top_k) != (layers, top_k):
        return f"routing of {col.layers} layers x top-{col.top_k}; the model has {layers} x top-{top_k}"
    if col.experts.shape[0] != expected_rows(prompt_len, lengths):
        return f"{col.experts.shape[0]} routing rows for {expected_rows(prompt_len, lengths)} positions"
    ids = col.experts
    if ids.size:
        real = ids[ids != col.none_value]
        if real.size and int(real.max()) >= experts:
            return f"expert id {int(real.max())} >= the model's {experts} experts"
        rows = ids.reshape(-1, top_k)  # pairs of columns: top_k (a few) x (top_k - 1) / 2 passes, no sort
        for a in range(top_k):
            for b in range(a + 1, top_k):
                if ((rows[:, a] == rows[:, b]) & (rows[:, a] != col.none_value)).any():
                    return "a token routed to the same expert twice in one layer"
    return None
