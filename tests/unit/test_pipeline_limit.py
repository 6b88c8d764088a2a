"""The pipeline's limit (report/limit.py) and the group file the two sides share (stream/group_file.py).

The limit is the slower side alone; efficiency is that limit over the pipeline's own time, checked against numbers
worked by hand. The group file must give the learner alone exactly the groups the engine alone generated.
"""

from __future__ import annotations

import math

import pytest
from test_stream_wire import assert_same, make_group

from asyncppo.report.limit import PipelineLimit
from asyncppo.stream.group_file import read_groups, write_groups


def test_limit_is_the_slower_side_and_efficiency_its_share_of_the_run():
    engine_bound = PipelineLimit(engine_s=30.0, learner_s=12.0, samples=2560, engine_occupancy=0.97)
    assert engine_bound.limit_s == 30.0 and engine_bound.slower_side == "engine"
    assert engine_bound.efficiency(40.0) == pytest.approx(0.75)  # 30 / 40
    assert engine_bound.efficiency(30.0) == pytest.approx(1.0)  # perfect overlap
    learner_bound = PipelineLimit(engine_s=9.5, learner_s=19.0, samples=2560)
    assert learner_bound.limit_s == 19.0 and learner_bound.slower_side == "learner"
    assert learner_bound.efficiency(36.2) == pytest.approx(19.0 / 36.2)
    assert math.isnan(learner_bound.engine_occupancy)
    d = engine_bound.as_dict()
    assert (d["limit_s"], d["slower_side"], d["samples"]) == (30.0, "engine", 2560)


@pytest.mark.parametrize("field, value", [("engine_s", 0.0), ("learner_s", -1.0), ("engine_s", math.nan)])
def test_limit_refuses_a_side_without_a_positive_time(field, value):
    kwargs = {"engine_s": 10.0, "learner_s": 5.0, "samples": 8, field: value}
    with pytest.raises(ValueError, match=field):
        PipelineLimit(**kwargs)


@pytest.mark.parametrize("bad", [0.0, -3.0, math.nan])
def test_efficiency_refuses_a_run_without_a_positive_time(bad):
    with pytest.raises(ValueError, match="run's time"):
        PipelineLimit(engine_s=10.0, learner_s=5.0, samples=8).efficiency(bad)


def test_group_file_round_trip_is_exact_and_a_truncated_file_names_the_offset(tmp_path):
    groups = [make_group(seed=s, n=4, T=40) for s in range(3)]
    path = str(tmp_path / "groups.bin")
    write_groups(path, groups)
    back = read_groups(path)
    assert len(back) == 3
    for a, b in zip(groups, back):
        assert_same(a, b)  # ids, log-probs and rewards bit for bit, ticket, prompt, versions
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-5])
    with pytest.raises(ValueError, match=r"groups\.bin: frame at byte \d+ needs"):
        read_groups(path)
