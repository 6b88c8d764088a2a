"""``rollout.sync_every=auto``'s rule (learner/push_cadence.py) on hand-computed numbers; the loop's use of it is in
test_learner_loop.py, the config's in test_config.py."""

import pytest

from asyncppo.learner.push_cadence import PushCadence, cadence


@pytest.mark.parametrize("load, step, j, expected", [
    (0.02, 0.07, 8, 3),  # 0.02 / 0.007 = 2.86: three steps keep loads within a tenth (data=reverse, quick box)
    (0.021, 0.146, 8, 2),  # 0.021 / 0.0146 = 1.44 (data=reverse, slow box): every second step, its hand-set value
    (0.02, 3.3, 8, 1),  # data=long: a load is 0.6% of a step
    (0.01, 0.1, 8, 1),  # exactly a tenth: every step
    (0.5, 0.1, 3, 3),  # 50 steps' worth asked, the lookahead allows 3
    (0.5, 0.1, 0, 1),  # j = 0 (synchronous PPO): every step, whatever the loads
    (0.0, 0.1, 8, 1),  # no load measured yet
    (0.02, 0.0, 8, 1),  # no step measured yet
])
def test_the_cadence_keeps_loads_within_a_tenth_of_the_time_and_within_the_lookahead(load, step, j, expected):
    assert cadence(load, step, j) == expected


def test_the_cadence_reads_medians_so_one_slow_load_does_not_move_it():
    c = PushCadence()
    for load in (0.02, 0.02, 0.02, 2.0, 0.0):  # one load of 2 s; a step without a load (0) is not a load
        c.observe({"time/step_s": 0.1, "sync/push_s": load})
    assert c.every(8) == 2  # median 0.02 -> 0.02 / 0.01 = 2
    for _ in range(10):  # the window keeps the last 10: the slow load is gone, loads now 0.05
        c.observe({"time/step_s": 0.1, "sync/push_s": 0.05})
    assert c.every(8) == 5


def test_a_change_of_cadence_is_said_once_and_its_range_kept():
    c = PushCadence()
    c.observe({"time/step_s": 0.1, "sync/push_s": 0.03})
    assert c.used(1) is None  # the start: no change
    line = c.used(c.every(8))
    assert line is not None and "every 1 -> 3 step(s)" in line and "0.030 s" in line
    assert c.used(3) is None and c.range == [1, 3]


def test_the_load_alone_is_read_where_the_record_has_it_else_the_push_latency():
    """``sync/load_s`` (receiving and loading) is the engines' pause; ``sync/push_s`` also counts the wait to see
    the announcement, and is read only where a workload reports no load alone (the embodied runners)."""
    c = PushCadence()
    c.observe({"time/step_s": 0.1, "sync/push_s": 0.09, "sync/load_s": 0.02})
    assert c.every(8) == 2
    embodied = PushCadence()
    embodied.observe({"time/step_s": 0.1, "sync/push_s": 0.04})
    assert embodied.every(8) == 4
