"""scripts/curves.py: the time a contender of scripts/bench_peer.py first reaches an accuracy, by hand."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "curves.py")
_spec = importlib.util.spec_from_file_location("bench_curves", _PATH)
curves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(curves)


def test_time_to_reach_interpolates_linearly_between_the_points_around_the_crossing():
    curve = [(0.0, 0.10), (100.0, 0.14), (200.0, 0.20), (300.0, 0.18)]
    # 0.17 lies between 0.14 (100 s) and 0.20 (200 s): half way -> 150 s
    assert curves.time_to_reach(curve, 0.17) == pytest.approx(150.0)
    # the first crossing counts, not a later dip below and back
    assert curves.time_to_reach(curve, 0.18) == pytest.approx(100.0 + 0.04 / 0.06 * 100.0)
    assert curves.time_to_reach(curve, 0.14) == pytest.approx(100.0)  # exactly at a point
    assert curves.time_to_reach(curve, 0.05) == 0.0  # the start already meets it
    assert curves.time_to_reach(curve, 0.21) is None  # never reached
    assert curves.time_to_reach([], 0.1) is None


def test_time_to_reach_refuses_points_out_of_time_order():
    with pytest.raises(ValueError, match="must not decrease"):
        curves.time_to_reach([(0.0, 0.1), (50.0, 0.2), (40.0, 0.3)], 0.15)


def test_compare_times_both_contenders_to_the_lower_final_and_takes_the_ratio():
    fast = [(0.0, 0.15), (60.0, 0.19), (120.0, 0.22)]
    slow = [(0.0, 0.15), (200.0, 0.17), (400.0, 0.21)]
    out = curves.compare({"fast": fast, "slow": slow}, fast="fast", slow="slow")
    assert out["finals"] == {"fast": 0.22, "slow": 0.21}
    assert out["threshold"] == 0.21
    # fast: 0.19 at 60 s -> 0.22 at 120 s, 0.21 is 2/3 of the way: 100 s; slow: its last point, 400 s
    assert out["reached"]["fast"] == pytest.approx(100.0)
    assert out["reached"]["slow"] == pytest.approx(400.0)
    assert out["speedup"] == pytest.approx(4.0)


def test_compare_says_when_the_ratio_is_undefined_or_unbounded():
    start_only = [(0.0, 0.3), (100.0, 0.2)]
    out = curves.compare({"a": start_only, "b": start_only}, fast="a", slow="b")
    assert out["threshold"] == 0.2 and out["reached"] == {"a": 0.0, "b": 0.0} and out["speedup"] is None
    never = curves.compare({"a": [(0.0, 0.1), (10.0, 0.3)], "b": [(0.0, 0.1), (10.0, 0.2)]}, "a", "b",
                           threshold=0.25)
    assert never["reached"]["b"] is None and math.isinf(never["speedup"])
    assert curves.compare({"a": [(0.0, 0.1), (10.0, 0.2)], "b": [(0.0, 0.1), (10.0, 0.3)]}, "a", "b",
                          threshold=0.25)["speedup"] is None
    with pytest.raises(ValueError, match="non-empty curves"):
        curves.compare({"a": [(0.0, 0.1)], "b": []}, "a", "b")
