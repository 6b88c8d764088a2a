"""The learner's engine figures from the timings that ride on each group (rollout/groups.py): per step and for the
run summary, by hand."""

from __future__ import annotations

import numpy as np

from asyncppo.metrics.rollout import EngineTotals
from asyncppo.stream.records import Sample, TrajectoryGroup


def _group(lengths: list[int], **timings: float) -> TrajectoryGroup:
    samples = [Sample(np.zeros(n, np.int32), np.zeros(n, np.float32), 0.0, "stop", 0, 0) for n in lengths]
    return TrajectoryGroup(f"g{len(timings)}-{lengths}", 0, np.zeros(2, np.int32), samples, timings=timings)


def test_occupancy_step_time_idle_and_unfilled_seconds_by_hand():
    totals = EngineTotals(max_num_seqs=4)
    a = _group([3, 5], decode_steps=10.0, running_seq_sum=30.0, engine_busy_s=0.5, idle_ticket_s=1.25,
               idle_weights_s=0.0, unfilled_ticket_s=0.125, unfilled_weights_s=0.0625, engine_gap_s=0.0625)
    b = _group([7], decode_steps=6.0, running_seq_sum=18.0, engine_busy_s=0.3, idle_ticket_s=0.0,
               idle_weights_s=0.5, inflight_updates=1.0, push_count=1.0, push_s_max=0.04, engine_gap_s=0.0625)
    step = totals.add([a, b])
    assert step["rollout/occupancy"] == 48 / (16 * 4)
    assert step["rollout/step_gap_s"] == 0.125 / 16  # the worker's seconds between two steps, per step
    assert step["rollout/decode_step_s"] == 0.8 / 16 and step["rollout/running_mean"] == 3.0
    assert step["rollout/idle_ticket_s"] == 1.25 and step["rollout/idle_weights_s"] == 0.5
    assert step["rollout/unfilled_ticket_s"] == 0.125 and step["rollout/unfilled_weights_s"] == 0.0625
    assert step["rollout/inflight_updates"] == 1.0 and step["sync/push_s"] == 0.04
    assert step["response_length/max"] == 7.0
    old = _group([2])  # a group from a worker that reports no idle seconds counts as none
    step2 = totals.add([old, _group([4], decode_steps=4.0, running_seq_sum=16.0, engine_busy_s=0.2,
                                    idle_ticket_s=0.25, unfilled_ticket_s=0.25)])
    assert step2["rollout/idle_ticket_s"] == 0.25 and step2["rollout/idle_weights_s"] == 0.0
    assert step2["rollout/unfilled_ticket_s"] == 0.25 and step2["rollout/unfilled_weights_s"] == 0.0
    summary = totals.summary()
    assert summary["idle_ticket_s"] == 1.5 and summary["idle_weights_s"] == 0.5
    assert summary["unfilled_ticket_s"] == 0.375 and summary["unfilled_weights_s"] == 0.0625
    assert summary["occupancy"] == 64 / (20 * 4) and summary["trained_tokens"] == 3 + 5 + 7 + 2 + 4
    # without the last step's groups (the run's drain rides on them): the first step's 48 of 16 x 4
    assert summary["occupancy_steady"] == 48 / (16 * 4)
    one_step = EngineTotals(max_num_seqs=4)
    one_step.add([a])
    assert one_step.summary()["occupancy_steady"] is None  # nothing before the last step
    # 64 sequence-steps (one token each) in 0.5 + 0.3 + 0.2 engine seconds, 20 steps
    assert summary["engine_step_s"] == 1.0 and summary["running_mean"] == 3.2
    assert summary["engine_gap_s"] == 0.125  # the groups without the key count none
    assert summary["decode_tokens_per_s"] == 64.0


def test_the_load_alone_and_every_load_are_counted_beside_the_push_latency():
    """``sync/load_s``: the slowest engine's time receiving and loading (the push cadence's input), beside
    ``sync/push_s``, which also holds the wait for the worker to see the announcement; ``weight_loads`` counts every
    load (a group's timings may carry several), ``pushes_measured`` the groups that carried some."""
    totals = EngineTotals(max_num_seqs=4)
    a = _group([3], push_count=2.0, push_s_max=0.05, load_s_max=0.02)
    b = _group([4], push_count=1.0, push_s_max=0.03, load_s_max=0.025)
    old = _group([5], push_count=1.0, push_s_max=0.04)  # a worker that reports no load alone
    step = totals.add([a, b, old])
    assert step["sync/push_s"] == 0.05 and step["sync/load_s"] == 0.025
    assert totals.add([_group([2])])["sync/load_s"] == 0.0  # no load in the step
    summary = totals.summary()
    assert summary["weight_loads"] == 4 and summary["pushes_measured"] == 3
