"""DAPO dynamic sampling with the real admission controller and ticket-ordered buffer: all-equal groups are skipped and
their tickets released, the batch is filled from the stream, the staleness bound holds, and nothing starves (k=0)."""

import threading
import time

import numpy as np
import pytest

from asyncppo.learner.dynamic_sampling import GroupFilter, rewards_all_equal
from asyncppo.staleness import AdmissionController, StalenessBuffer
from asyncppo.stream.records import Sample, TrajectoryGroup

B, STEPS = 4, 6


def _group(ticket, version, rewards):
    samples = [Sample(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), r, "stop", version, version)
               for r in rewards]
    return TrajectoryGroup(f"g{ticket}-{version}", 0, np.zeros(2, np.int32), samples, ticket=ticket)


def _worker(ctrl, buf, versions, stop, produced):
    """Generates for every ticket it gets, with the newest weights; every 3rd group it makes has equal rewards."""
    n = 0
    while not stop.is_set():
        t = ctrl.try_acquire()
        if t is None:
            time.sleep(0.001)
            continue
        v = versions[-1]
        assert v >= t.min_version
        rewards = [1.0, 1.0] if n % 3 == 0 else [0.0, 1.0]
        n += 1
        produced.append(rewards_all_equal(_group(0, 0, rewards)))
        buf.put(_group(t.index, v, rewards), timeout_s=5)


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("max_skip", [100, 1])
def test_skipped_groups_are_released_and_refilled(k, max_skip):
    ctrl = AdmissionController(B, k)
    filt = GroupFilter(ctrl, enabled=True, max_skip=max_skip)
    buf = StalenessBuffer(k, capacity_groups=(k + 2) * B, on_drop=lambda g: ctrl.release(g.ticket),
                          on_take=filt.on_take, order=ctrl)
    versions, stop, produced = [0], threading.Event(), []
    th = threading.Thread(target=_worker, args=(ctrl, buf, versions, stop, produced))
    th.start()
    skipped_per_step, equal_trained = [], 0
    try:
        for v in range(STEPS):
            filt.start_step()
            groups, deadline = [], time.monotonic() + 20
            while len(groups) < B:
                groups += filt.keep(buf.take(B - len(groups), v, timeout_s=1.0))
                assert time.monotonic() < deadline, f"starved at version {v}: {ctrl.stats()}"
            assert len(groups) == B
            assert all(v - s.version_min <= k for g in groups for s in g.samples)
            equal_trained += sum(rewards_all_equal(g) for g in groups)
            skipped_per_step.append(filt.metrics()["batch/skipped_groups"])
            stats = ctrl.stats()
            assert stats["live"] <= stats["capacity"]
            assert stats["consumed"] == (v + 1) * B  # only trained groups keep a slot
            versions.append(v + 1)
            ctrl.set_version(v + 1)
    finally:
        stop.set()
        th.join(10)
    assert filt.skipped_total == sum(skipped_per_step) > 0
    assert ctrl.stats()["released"] >= filt.skipped_total  # every skipped ticket went back to the pool
    if max_skip >= 100:
        assert equal_trained == 0  # the batch was filled with groups that carry signal
    else:
        assert max(skipped_per_step) <= 1  # the cap: after one skip per step the rest is trained as it is


def test_disabled_filter_consumes_everything():
    ctrl = AdmissionController(1, 0)
    filt = GroupFilter(ctrl, enabled=False, max_skip=10)
    t = ctrl.try_acquire()
    g = _group(t.index, 0, [1.0, 1.0])
    filt.on_take(g)
    assert filt.keep([g]) == [g] and ctrl.stats()["consumed"] == 1 and filt.skipped_total == 0
    with pytest.raises(ValueError, match="max_skip"):
        GroupFilter(ctrl, enabled=True, max_skip=-1)
