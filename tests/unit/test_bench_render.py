"""docs/benchmarks.md is rendered from result files (asyncppo/bench/render.py). A golden file: a small fixture set
(tests/unit/bench_fixtures/: two results, one measured and one transcribed, a prose file, and a third benchmark
with no result) must render to exactly bench_fixtures/expected.md. And the committed page must be the rendering of
the committed results, so a result recorded without re-rendering (or a hand edit of the page) fails here."""

from __future__ import annotations

import os

from asyncppo.bench.registry import BENCHMARKS, Benchmark
from asyncppo.bench.render import number, read_prose, render, slug
from asyncppo.bench.result import Target

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "bench_fixtures")
REPO = os.path.dirname(os.path.dirname(HERE))

FIXTURE_BENCHMARKS = [
    Benchmark("alpha", "Alpha: a measured ratio", "Is alpha fast enough?", "ratio",
              Target("ratio", ">=", 0.9, over="every seed", min_seeds=2, why="a fixture's target"), "~1 min",
              "asyncppo.bench.transport:run", seeds=(0, 1), options={"n": 1},
              history=(("benchmarks/history/diary-2026.md", "Transport"),)),
    Benchmark("beta", "Beta: a transcribed cost", "How long does beta take?", "seconds", None, "~2 min",
              "asyncppo.bench.shm_push:run"),
    Benchmark("gamma", "Gamma: never run", "Has gamma been measured?", "x", Target("x", "<=", 1.0, why="fixture"),
              "~3 min", "asyncppo.bench.fanout:run"),
]


def test_the_fixture_set_renders_to_the_golden_file():
    text = render(FIXTURE_BENCHMARKS, os.path.join(FIXTURES, "results"), os.path.join(FIXTURES, "prose.md"))
    with open(os.path.join(FIXTURES, "expected.md"), encoding="utf-8") as f:
        assert text == f.read()


def test_the_committed_page_is_the_rendering_of_the_committed_results():
    text = render(BENCHMARKS, os.path.join(REPO, "docs", "benchmarks", "results"),
                  os.path.join(REPO, "docs", "benchmarks", "prose.md"))
    with open(os.path.join(REPO, "docs", "benchmarks.md"), encoding="utf-8") as f:
        assert f.read() == text, "docs/benchmarks.md is stale: run `asyncppo bench --render`"


def test_the_prose_stays_short():
    with open(os.path.join(REPO, "docs", "benchmarks", "prose.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 400
    intro, sections = read_prose(os.path.join(REPO, "docs", "benchmarks", "prose.md"))
    assert intro and set(sections) <= {b.name for b in BENCHMARKS}


def test_anchors_and_numbers():
    assert slug("On one shared H200: the preset `k = 12, j = 3`, sync beside it") == \
        "on-one-shared-h200-the-preset-k--12-j--3-sync-beside-it"
    assert slug("`data=long` against TRL's GRPOTrainer: accuracy against time (issue #21 item 5)") == \
        "datalong-against-trls-grpotrainer-accuracy-against-time-issue-21-item-5"
    assert [number(v) for v in (None, 0.0, 0.908, 2.0825, 99840.0, -0.004, 144.0)] == \
        ["-", "0", "0.908", "2.08", "99,840", "-0.004", "144"]
