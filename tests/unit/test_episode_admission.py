"""Admission for multi-turn episodes counts the engine load the episodes in flight will make (Little's law), not the
sequences in the engine this instant; and the worker's episode spread (where its episodes are) reaches the step
metrics as time-weighted means."""

from __future__ import annotations

import numpy as np
import pytest

from asyncppo.staleness.episode_load import EngineShare, engine_load
from asyncppo.metrics.rollout import episode_metrics
from asyncppo.stream.records import Sample, TrajectoryGroup


def test_engine_share_is_the_time_weighted_fraction_in_the_engine():
    share = EngineShare()
    assert share.share == 1.0  # nothing seen: admission as for single turns
    # waves: 40 episodes in the engine for 0.1 s, then all 40 at the tool for 0.3 s, over and over
    t = 0.0
    for _ in range(100):
        share.add(40, 0, now=t)
        t += 0.1
        share.add(0, 40, now=t)
        t += 0.3
    # the instant count swings between 40 and 0; the share settles at 0.1 / 0.4 (a moving average: within 0.05)
    assert share.share == pytest.approx(0.25, abs=0.05)
    # constant counts give their exact ratio whatever the history's length
    steady = EngineShare()
    for i in range(5):
        steady.add(10, 30, now=float(i))
    assert steady.share == pytest.approx(0.25, abs=1e-12)
    # the tool gets fast: after many horizons the share is back near 1
    for i in range(5, 5 + int(20 * EngineShare.horizon_s)):
        steady.add(40, 0, now=float(i))
    assert steady.share > 0.99


def test_engine_load_counts_the_expected_load_and_a_full_engine_as_full():
    # 160 episodes in flight that spend a quarter of their time in the engine load it like 40 sequences
    assert engine_load(running=0, in_flight=160, share=0.25) == 40
    # ... even while all of them wait for the tool, or all of them are back at once (then the engine is full)
    assert engine_load(running=64, in_flight=160, share=0.25) == 64
    # a single-turn-like share of 1 is the in-flight count: admission as before
    assert engine_load(running=24, in_flight=24, share=1.0) == 24
    assert engine_load(running=0, in_flight=7, share=0.5) == 4  # rounded up: never under-counted


def _sample(n: int) -> Sample:
    return Sample(np.zeros(n, np.int32), np.zeros(n, np.float32), 0.0, "stop", 0, 0,
                  env_runs=np.asarray([[1, 2]], np.int64), turn_rewards=np.zeros(2))


def test_episode_spread_reaches_the_step_metrics_as_time_weighted_means():
    # group a covered 1 s of worker time with 100 episodes at the tool on average, b covered 3 s with 20
    a = TrajectoryGroup("a", 0, np.zeros(2, np.int32), [_sample(4)],
                        timings={"spread_s": 1.0, "at_env_sum": 100.0, "in_engine_sum": 10.0, "groups_sum": 12.0,
                                 "tickets_waiting_sum": 0.0})
    b = TrajectoryGroup("b", 0, np.zeros(2, np.int32), [_sample(4)],
                        timings={"spread_s": 3.0, "at_env_sum": 60.0, "in_engine_sum": 90.0, "groups_sum": 36.0,
                                 "tickets_waiting_sum": 6.0})
    m = episode_metrics([a, b])
    assert m["episodes/at_env_mean"] == 160 / 4 and m["episodes/in_engine_mean"] == 100 / 4
    assert m["episodes/groups_mean"] == 48 / 4 and m["episodes/tickets_waiting_mean"] == 6 / 4
