"""Admission controller formula and the staleness buffer, as pure logic."""

import threading
import time

import numpy as np
import pytest

from asyncppo.staleness import AdmissionController, StalenessBuffer, Ticket
from asyncppo.stream.records import Sample, TrajectoryGroup


def drain(ctrl):
    out = []
    while (t := ctrl.try_acquire()) is not None:
        out.append(t)
    return out


def test_controller_formula_by_hand():
    c = AdmissionController(batch_groups=3, max_staleness=2)
    # v = 0: i < (2 + 0 + 1) * 3 = 9, min_version = i // 3 - 2 -> clamped at 0
    assert drain(c) == [Ticket(i, 0) for i in range(9)]
    c.set_version(1)  # i < 12; tickets 9..11 need version 9 // 3 - 2 = 1
    assert drain(c) == [Ticket(9, 1), Ticket(10, 1), Ticket(11, 1)]
    c.set_version(3)  # i < 18; 12..14 -> 2, 15..17 -> 3
    assert drain(c) == [Ticket(i, i // 3 - 2) for i in range(12, 18)]
    assert c.stats()["granted"] == 18 and c.stats()["in_flight"] == 18


def test_k0_is_synchronous():
    c = AdmissionController(batch_groups=4, max_staleness=0)
    for v in range(5):
        c.set_version(v)
        assert drain(c) == [Ticket(i, v) for i in range(4 * v, 4 * v + 4)]


def test_release_regrants_index_with_recomputed_min_version():
    B, k = 2, 1
    c = AdmissionController(B, k)
    ts = drain(c)  # 0..3, all min 0
    assert [t.index for t in ts] == [0, 1, 2, 3]
    for t in ts[:2]:
        c.consumed(t)
    c.set_version(1)
    assert drain(c) == [Ticket(4, 1), Ticket(5, 1)]
    # ticket 2 (min 0) came back stale. Granted again it is the lowest outstanding, so the learner trains it in the
    # batch of version 1 (beside ticket 3): it needs weights 1 - k = 0, not those of slot 5 (5 // 2 - 1 = 1), which
    # with pushes every second version the engines would get only after that batch
    c.release(ts[2])
    assert c.try_acquire() == Ticket(2, 0) and c.deadline_of(2) == 1
    assert c.try_acquire() is None  # pool size unchanged: 6 live = (k + v + 1) * B
    for t in (ts[3], Ticket(4, 1), Ticket(5, 1), Ticket(2, 0)):
        c.consumed(t)
    c.set_version(3)  # capacity 10, live 6
    got = drain(c)
    assert [t.index for t in got] == [6, 7, 8, 9]
    assert [t.min_version for t in got] == [2, 2, 3, 3]  # slots 6..9, all >= v - k = 2
    assert c.release(2) is False  # consumed: can't come back (a counted no-op, never an exception)
    assert c.release(9) is True
    assert c.release(9) is False  # double release would widen the pool
    assert c.release(-1) is False  # "not admission-controlled": nothing to give back
    s = c.stats()
    assert (s["granted"], s["released"], s["live"], s["capacity"]) == (11, 2, 9, 10)
    assert s["release_unknown"] == 3


def test_no_ticket_past_the_runs_last_slot_and_a_released_one_is_granted_again():
    """A run of 3 steps of B = 2 trains slots 0..5: the window (k = 2: 6 tickets at v = 0, 8 at v = 1) stops there,
    and a ticket released near the end (a dropped or skipped group) is still granted again."""
    B, k, steps = 2, 2, 3
    c = AdmissionController(B, k, total_slots=steps * B)
    assert drain(c) == [Ticket(i, 0) for i in range(6)]
    c.set_version(1)  # the window says 8; the run has 6 slots
    assert drain(c) == [] and c.stats()["capacity"] == 6
    assert c.release(5) is True
    # index 5 again; nothing was trained at v = 1 here, so it queues behind 5 tickets: batch 1 + 5 // 2 = 3, whose
    # tickets need weights 3 - k = 1
    assert c.try_acquire() == Ticket(5, 1) and c.try_acquire() is None
    c.set_version(3)
    assert drain(c) == []
    resumed = AdmissionController(B, k, start_version=2, total_slots=steps * B)  # slots 0..3 trained before
    assert drain(resumed) == [Ticket(4, 0), Ticket(5, 0)]
    with pytest.raises(ValueError, match="total_slots"):
        AdmissionController(B, k, start_version=2, total_slots=3)


def test_controller_invariants_under_random_drops():
    rng = np.random.default_rng(0)
    for B, k in [(1, 0), (3, 1), (4, 4)]:
        c = AdmissionController(B, k)
        v = 0
        outstanding = []
        for step in range(300):
            for t in drain(c):
                assert t.min_version >= v - k and t.min_version <= v  # fresh enough, and attainable now
                outstanding.append(t)
            assert c.stats()["live"] <= (k + v + 1) * B
            rng.shuffle(outstanding)
            # drop some, consume B, bump the version
            for _ in range(int(rng.integers(0, 2))):
                if outstanding:
                    c.release(outstanding.pop())
            if len(outstanding) >= B:
                for t in outstanding[:B]:
                    c.consumed(t)
                del outstanding[:B]
                v += 1
                c.set_version(v)
        assert v > 100


def test_controller_validation_and_threads():
    with pytest.raises(ValueError):
        AdmissionController(0, 1)
    with pytest.raises(ValueError):
        AdmissionController(2, -1)
    c = AdmissionController(batch_groups=50, max_staleness=1)
    got = []
    lock = threading.Lock()

    def grab():
        for t in drain(c):
            with lock:
                got.append(t.index)

    ts = [threading.Thread(target=grab) for _ in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(got) == list(range(100))
    with pytest.raises(ValueError):
        c.set_version(-1)
    c.stop()
    c.set_version(5)
    assert c.try_acquire() is None


def group(gid, vmin, vmax=None, n=2):
    return TrajectoryGroup(
        group_id=gid, worker_id=0, prompt_ids=np.zeros(2, np.int32),
        samples=[Sample(np.zeros(3, np.int32), np.zeros(3, np.float32), 0.0, "stop", vmin, vmax if vmax is not None else vmin)
                 for _ in range(n)],
    )


def test_buffer_drops_stale_whole_groups_and_reports():
    dropped, taken = [], []
    buf = StalenessBuffer(max_staleness=1, capacity_groups=10, on_drop=dropped.append, on_take=taken.append)
    g = [group("a", 3), group("b", 1), group("c", 2, 4), group("d", 4), group("e", 0)]
    g[2].samples[1].version_min = 0  # one old sample makes the whole group stale
    for x in g:
        assert buf.put(x)
    out = buf.take(2, learner_version=4)
    # lags at v=4: a 1, b 3 (drop), c 4 (drop: version_min is the group's oldest sample), d 0, e 4 (drop)
    assert [x.group_id for x in out] == ["a", "d"]
    assert [x.group_id for x in dropped] == ["b", "c", "e"]
    assert all(len(x.samples) == 2 for x in out + dropped)  # whole groups
    assert taken == out
    s = buf.stats()
    assert (s["size"], s["dropped_stale"], s["dropped_samples"], s["taken"]) == (0, 3, 6, 2)
    assert (s["lag_min"], s["lag_mean"], s["lag_max"]) == (0, 0.5, 1)


def test_buffer_take_waits_times_out_without_losing_and_put_blocks():
    buf = StalenessBuffer(max_staleness=0, capacity_groups=2)
    buf.put(group("a", 5))
    t0 = time.monotonic()
    assert buf.take(2, learner_version=5, timeout_s=0.1) == []
    assert time.monotonic() - t0 >= 0.09 and len(buf) == 1
    buf.put(group("b", 5))
    assert not buf.put(group("c", 5), timeout_s=0.05)  # full

    def later():
        time.sleep(0.1)
        buf.take(1, learner_version=5)

    th = threading.Thread(target=later)
    th.start()
    assert buf.put(group("c", 5), timeout_s=5)  # unblocked by the take
    th.join()
    assert [x.group_id for x in buf.take(2, learner_version=5)] == ["b", "c"]
    with pytest.raises(ValueError):
        buf.take(3, learner_version=5)
    buf.close()
    assert buf.take(1, learner_version=5) == []
