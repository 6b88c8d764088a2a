"""asyncppo/bench/plot_peer.py: the accuracy-against-time picture of the peer benchmark on data=long, by hand."""

from __future__ import annotations

import pytest
from PIL import Image

from asyncppo.bench import curves


@pytest.fixture(scope="module")
def plot_peer():
    from asyncppo.bench import plot_peer

    return plot_peer


def _doc(with_trl: bool = True) -> dict:
    point = lambda t, s, g: {"step": int(t), "train_s": t, "sampled": s, "greedy": g}  # noqa: E731
    results = [{"name": "asyncppo", "points": [point(100.0, 0.50, 0.70), point(200.0, 0.60, 0.72)]}]
    if with_trl:
        results.append({"name": "trl", "points": [point(150.0, 0.30, 0.60), point(300.0, 0.45, 0.66)]})
    return {"start": {"sampled": 0.20, "greedy": 0.60}, "results": results, "seconds": 300.0}


def test_markers_are_where_each_curve_first_reaches_the_lower_final(plot_peer, tmp_path):
    out = tmp_path / "peer.png"
    shown = plot_peer.plot(_doc(), str(out))
    # the lower final is TRL's 0.45; asyncppo's line from (0 s, 0.20) to (100 s, 0.50) crosses it at 0.25 / 0.30 of
    # the way: 83.3 s; TRL reaches it at its last point, 300 s
    assert shown["threshold"] == pytest.approx(0.45)
    assert shown["reached"]["asyncppo"] == pytest.approx(250.0 / 3.0)
    assert shown["reached"]["trl"] == pytest.approx(300.0)
    assert shown["speedup"] == pytest.approx(3.6)
    assert shown["at_least"] == pytest.approx(3.0)  # asyncppo's first scored point at or above it is 100 s
    with Image.open(out) as image:
        assert image.size == (1000, 420)


def test_one_contender_alone_is_drawn_without_markers(plot_peer, tmp_path):
    out = tmp_path / "alone.png"
    assert plot_peer.plot(_doc(with_trl=False), str(out)) == {}
    assert out.stat().st_size > 0
    assert curves.curves_of(_doc(with_trl=False))["asyncppo"] == [(0.0, 0.2), (100.0, 0.5), (200.0, 0.6)]
