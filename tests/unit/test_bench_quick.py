"""``asyncppo bench --quick``'s comparison (asyncppo/bench/quick.py), by hand: when a fresh figure counts as moved
beyond the committed spread, and what the printed table shows."""

from __future__ import annotations

import pytest

from asyncppo.bench.quick import band, compare, table
from asyncppo.bench.registry import get
from asyncppo.bench.result import Figure, Machine, Result


def _result(values: dict, name: str = "shm-push") -> Result:
    bench = get(name)
    figs = [Figure.of(n, v) for n, v in values.items()]
    return Result.build(name=name, question=bench.question, command="c", config={}, seeds=[0], git={"commit": "x",
                        "dirty": False}, machine=Machine(), figures=figs, target=bench.target, date="2026-11-29",
                        headline=bench.headline)


def test_the_band_is_the_committed_range_widened_by_the_larger_of_std_and_tolerance():
    one = Figure.of("f", {0: 2.0})  # one seed: std 0, the tolerance alone
    assert band(one, 0.25) == pytest.approx((1.5, 2.5))
    three = Figure.of("f", {0: 1.0, 1: 2.0, 2: 3.0})  # std 1.0 beats 0.1 x 2.0
    assert band(three, 0.1) == pytest.approx((0.0, 4.0))
    assert band(Figure.of("f", {0: None}), 0.25) is None


def test_compare_flags_what_moved_and_the_table_shows_the_headline_and_every_moved_figure():
    bench = get("shm-push")  # tolerance 0.5
    committed = _result({"gloo/shm": {0: 1.6}, "gloo sender s": {0: 1.0}, "shm sender s": {0: 0.7}})
    fresh = _result({"gloo/shm": {0: 2.3}, "gloo sender s": {0: 2.0}, "shm sender s": {0: 0.8},
                     "shm GB/s": {0: 0.3}})
    rows = compare(bench, fresh, committed)
    assert rows[0].figure == "gloo/shm" and rows[0].headline and rows[0].moved is False  # 2.3 within 0.8 to 2.4
    moved = {r.figure: r.moved for r in rows}
    assert moved == {"gloo/shm": False, "gloo sender s": True, "shm sender s": False, "shm GB/s": None}
    text = table(rows, {"shm-push": ("met", "met")})
    assert "| shm-push | gloo/shm | 1.6 (n=1) | 2.3 | no |" in text
    assert "| shm-push | gloo sender s | 1 (n=1) | 2 | **MOVED** |" in text
    assert "shm sender s" not in text  # neither the headline nor moved
    assert "| shm-push | met | met |" in text
    assert compare(bench, fresh, None)[0].moved is None  # nothing committed: nothing to flag
