"""Validation and layout of per-token version spans for the wire format (:mod:`asyncppo.stream.wire`).

Why this module exists: a sample's per-token policy versions travel as run-length spans, rows of (int64
start_token_index, int64 version), one row per version used (see :mod:`asyncppo.stream.records` for what spans
mean and :mod:`asyncppo.stream.wire` for the rules and the frame layout). Both ends check every span: the checks are
vectorised over a group's concatenated spans so that a message costs a fixed number of numpy calls whatever its
sample and span counts, and a per-sample walk (:func:`asyncppo.stream.records.check_spans`) runs only on the error
path, to name the offending sample.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any

import numpy as np

from asyncppo.stream.errors import WireError
from asyncppo.stream.records import check_spans

_I8 = np.dtype("<i8")
_NONE = frozenset({type(None)})
_PAIRS: dict[int, struct.Struct] = {}


def _pairs(n: int) -> struct.Struct:
    """``n`` int64 pairs: the span region of a group whose samples each have one span."""
    st = _PAIRS.get(n)
    if st is None:
        st = struct.Struct(f"<{2 * n}q")
        if len(_PAIRS) < 64:
            _PAIRS[n] = st
    return st


def _explain_spans(spans: np.ndarray, counts: Any, lengths: Any, vmin: Any, vmax: Any) -> WireError:
    """Walk the samples one by one to name the first whose spans break a rule (error path only)."""
    start = 0
    for j, (c, T, v0, v1) in enumerate(zip(counts, lengths, vmin, vmax)):
        c = int(c)
        if c < 1:
            return WireError("schema", f"samples[{j}].version_spans: span count {c}, a sample has at least one")
        problem = check_spans(spans[start : start + c], int(T), int(v0), int(v1))
        if problem is not None:
            return WireError("schema", f"samples[{j}].version_spans {problem}")
        start += c
    return WireError("schema", "version spans do not satisfy the span rules")


_nonzero = np.count_nonzero  # C-level reductions: ndarray.any()/min() go through Python wrappers
_min = np.minimum.reduce


def _check_spans(spans: np.ndarray, counts: Any, lengths: Any, vmin: Any, vmax: Any,
                 span_offsets: Any = None) -> None:
    """Check the concatenated int64 ``[S, 2]`` ``spans`` of ``n`` samples against the span rules (module
    docstring) and raise a ``schema`` :class:`WireError` naming the first bad sample.

    ``counts``, ``lengths``, ``vmin``, ``vmax`` are ``n`` ints each with ``sum(counts) == S``; ``span_offsets``
    (their running sum from 0) is computed when not given. The checks are a fixed number of numpy operations over
    the whole array, whatever ``n`` and ``S``: a sample's starts run 0 < s1 < ... < s_last < max(T, 1) and its
    versions vmin = v0 < ... < v_last = vmax, so it suffices to check that no value is negative (which also keeps
    the differences below from overflowing), that every within-sample step is positive in both columns, that each
    first row is (0, vmin) and each last row is (< max(T, 1), vmax) (this also bounds the span count by
    max(T, 1))."""
    n = len(counts)
    if min(counts) < 1:
        raise _explain_spans(spans, counts, lengths, vmin, vmax)
    if spans.shape[0] == n:  # every count is 1: one policy version per sample (the common case)
        flat = spans.ravel().tolist()  # n pairs: cheaper as small Python lists than as numpy calls
        vmin = list(vmin)
        if not any(flat[0::2]) and flat[1::2] == vmin == list(vmax) and min(vmin) >= 0:
            return
        raise _explain_spans(spans, counts, lengths, vmin, vmax)
    if span_offsets is None:
        span_offsets = list(itertools.accumulate(counts, initial=0))
    soff = np.asarray(span_offsets, dtype=np.int64)
    last = soff[1:] - 1  # each sample's last row; its first row is soff[:-1]
    step = spans[1:] - spans[:-1]
    step[last[:-1]] = 1  # the step from one sample's last row to the next sample's first row is not ordered
    head, tail = spans[soff[:-1]], spans[last]
    if (
        _min(spans, axis=None) < 0  # first: with every value >= 0 no step below can wrap around
        or _min(step, axis=None) <= 0
        or _nonzero(head[:, 0])
        or head[:, 1].tolist() != list(vmin)
        or tail[:, 1].tolist() != list(vmax)
        or _nonzero(tail[:, 0] >= np.maximum(lengths, 1))
    ):
        raise _explain_spans(spans, counts, lengths, vmin, vmax)


def _bad_spans(spans: Any, where: str) -> WireError:
    what = f"dtype {spans.dtype}, shape {spans.shape}" if isinstance(spans, np.ndarray) else type(spans).__name__
    return WireError("schema", f"{where}version_spans must be an integer numpy array of shape [S, 2], got {what}")


def _span_counts(vspans: list) -> list:
    """The span count of each sample (None counts as one span); refuses a ``version_spans`` that is not an
    integer ``[S, 2]`` array. The rules are checked by :func:`_spans_region`, after the scalars are packed."""
    n = len(vspans)
    if set(map(type, vspans)) == _NONE:
        return [1] * n
    counts = []
    for j, sp in enumerate(vspans):
        if sp is None:
            counts.append(1)
        elif type(sp) is not np.ndarray or sp.ndim != 2 or sp.shape[1] != 2 or sp.dtype.kind not in "iu":
            raise _bad_spans(sp, f"samples[{j}].")
        else:
            counts.append(sp.shape[0])
    return counts


def _none_with_two_versions(j: int, a: Any, b: Any) -> WireError:
    return WireError("schema", f"samples[{j}]: version_min={a} != version_max={b} but version_spans is None "
                               f"(None means one version for every token; give the spans)")


def _spans_region(src: Any, counts: list, lengths: list, vmin: list, vmax: list) -> Any:
    """The validated span region (bytes, or a C-contiguous little-endian int64 ``[S, 2]`` array) from either the
    samples' ``version_spans`` (a list) or a columnar group's concatenated spans (an array)."""
    if type(src) is np.ndarray:  # columns: already concatenated
        spans = src.astype(_I8, copy=False)
        _check_spans(spans, counts, lengths, vmin, vmax)
        return spans
    n = len(src)
    if set(map(type, src)) == _NONE:  # the common case: no sample changed weights mid-generation
        if vmin != vmax:
            j = next(j for j, (a, b) in enumerate(zip(vmin, vmax)) if a != b)
            raise _none_with_two_versions(j, vmin[j], vmax[j])
        if min(vmin) < 0:
            j = next(j for j, v in enumerate(vmin) if v < 0)
            raise WireError("schema", f"samples[{j}].version_spans: version {vmin[j]} must be >= 0")
        return _pairs(n).pack(*[x for v in vmin for x in (0, v)])
    parts = []
    for j, (sp, a, b) in enumerate(zip(src, vmin, vmax)):
        if sp is not None:
            parts.append(sp)
        elif a != b:
            raise _none_with_two_versions(j, a, b)
        else:
            parts.append(np.array([[0, a]], dtype=_I8))
    spans = np.concatenate(parts).astype(_I8, copy=False)
    _check_spans(spans, counts, lengths, vmin, vmax)
    return spans
