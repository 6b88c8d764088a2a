"""A released ticket granted again (its group was dropped as stale, skipped by dynamic sampling, refused at the door,
or lost with a dead worker) must not stall the run: it joins the batch it will be trained in, and the worker starts
it ahead of tickets granted before it that need newer weights.

Found by review: with pushes every ``s >= 2`` versions, a skip at a version that was not pushed re-granted the
ticket with the min_version of the window's newest slot (the version being trained); the engines never held those
weights before that very batch, and the learner waited until its timeout. The simulation is the one of
tests/unit/test_staleness_lookahead.py (real controller, ticket-ordered buffer, the worker's own
:func:`take_startable`, tick clock, no sockets) with pushes every ``s`` versions and groups skipped at random as
``learner/dynamic_sampling.py`` skips them (released on take; the learner takes more until ``B`` are kept).
"""

from __future__ import annotations

import collections
import random

import pytest

from asyncppo.staleness import AdmissionController, StalenessBuffer, Ticket
from asyncppo.staleness.order import take_startable
from tests.unit.test_staleness_lookahead import worker_tick


def test_a_skipped_ticket_is_granted_for_its_own_batch_and_started_first():
    """B = 2, k = j = 1, pushes every 2 versions: at version 1 (not pushed, the engines hold version 0) ticket 2's
    group is skipped; granted again it needs weights 0 (it is trained at version 1), and the worker, holding tickets
    4 and 5 that need version 1, starts it."""
    ctrl = AdmissionController(2, 1)
    assert [t.index for t in [ctrl.try_acquire() for _ in range(4)]] == [0, 1, 2, 3]
    ctrl.consumed(0), ctrl.consumed(1)
    ctrl.set_version(1)
    pending = collections.deque([ctrl.try_acquire(), ctrl.try_acquire()])
    assert list(pending) == [Ticket(4, 1), Ticket(5, 1)]
    assert ctrl.release(2)  # skipped at version 1
    pending.append(ctrl.try_acquire())
    assert pending[-1] == Ticket(2, 0) and ctrl.deadline_of(2) == 1
    assert take_startable(pending, 0) == Ticket(2, 0)
    assert take_startable(pending, 0) is None and list(pending) == [Ticket(4, 1), Ticket(5, 1)]
    assert take_startable(pending, 1) == Ticket(4, 1)


def test_take_startable_takes_the_lowest_index_the_weights_allow():
    pending = collections.deque([Ticket(9, 3), Ticket(7, 2), Ticket(8, 1), Ticket(6, 4)])
    assert take_startable(pending, 2) == Ticket(7, 2)
    assert take_startable(pending, 2) == Ticket(8, 1)
    assert take_startable(pending, 2) is None and len(pending) == 2


def _simulate(seed: int, *, k: int, j: int, B: int, workers: int, s: int, p_skip: float, steps: int = 30,
              slots: int | None = None, cap: int | None = None, p_move: float = 0.0) -> dict:
    """The run (module docstring). ``cap`` and ``p_move`` (tests/unit/test_staleness_moving_window.py): the buffer's
    guard is ``cap`` and, at each tick with probability ``p_move``, the window moves within ``s - 1 <= j <= k <=
    cap``; every group taken is checked against its own ticket's ``k`` (recorded at each grant, re-grants included)."""
    rng = random.Random(seed)
    cap = k if cap is None else cap
    ctrl = AdmissionController(B, cap, lookahead=j)
    if cap != k:
        ctrl.set_window(k, j)
    skipped: set[int] = set()
    budget = [0]  # skips left at this version (dynamic sampling gives up after a few rounds)
    bounds: dict[int, int] = {}

    class Grants(dict):  # every grant, re-grants included: the k its ticket carries
        def __setitem__(self, index, deadline):
            super().__setitem__(index, deadline)
            bounds[index] = ctrl.bound_of(index)

    def on_take(g):
        if budget[0] > 0 and rng.random() < p_skip:
            budget[0] -= 1
            skipped.add(id(g))
            ctrl.release(g.ticket)
        else:
            ctrl.consumed(g.ticket)

    buf = StalenessBuffer(cap, capacity_groups=(cap + 2) * B + 64, order=ctrl, on_take=on_take,
                          on_drop=lambda g: ctrl.release(g.ticket))
    slots = (cap + 1) * B // workers + 2 if slots is None else slots  # default: engines hold the whole window
    ws = [{"version": 0, "loads": [], "pending": collections.deque(), "flights": []} for _ in range(workers)]
    grants = Grants()
    v, busy, tick, kept, lags, trained, moves = 0, 0, 0, [], [], 0, 0
    budget[0] = 2 * B
    while v < steps:
        tick += 1
        assert tick < 100_000, f"seed {seed}: stuck at version {v}, waiting for tickets {buf.missing(B)}; {ctrl.stats()} {buf.stats()} kept {len(kept)}"
        if p_move and rng.random() < p_move:
            k = max(s - 1, min(cap, k + rng.choice([-1, 1, -cap, cap])))
            j = rng.randint(s - 1, k)
            ctrl.set_window(k, j)
            moves += 1
        if busy:
            busy -= 1
            if not busy:
                v += 1
                ctrl.set_version(v)
                budget[0] = 2 * B
                if v % s == 0:  # rollout.sync_every: only these versions reach the engines
                    for w in ws:
                        w["loads"].append((tick + rng.choice([0, 1, 2, 3, 8]), v))
        else:
            got = buf.take(B - len(kept), v, timeout_s=0)
            for g in got:
                if id(g) not in skipped:
                    lag = max(v - int(x) for x in g.samples[0].token_versions())
                    assert lag <= bounds[g.ticket] <= cap, f"seed {seed}: ticket {g.ticket} lag {lag}"
                    kept.append(g)
            skipped.clear()  # ids of freed objects are reused
            if len(kept) == B:
                lags += [v - g.version_min for g in kept]
                trained += B
                kept, busy = [], rng.randint(3, 10)
        for w in ws:
            worker_tick(w, tick, ctrl, buf, rng, slots, grants)
    return {"lags": lags, "trained": trained, "stats": buf.stats(), "moves": moves}


SHAPES = [(4, 2, 1), (3, 4, 2), (2, 3, 3), (4, 1, 1)]  # (k, B, workers)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"k{s[0]}-B{s[1]}-w{s[2]}" for s in SHAPES])
def test_skips_and_pushes_every_few_versions_never_stall_drop_or_train_past_the_bound(shape):
    k, B, workers = shape
    for s in range(1, k + 2):  # every sync_every the bound allows: k >= s - 1
        for j in range(s - 1, k + 1):  # and every lookahead it allows: j >= s - 1
            # engines that hold the whole window, and engines whose room is a group or two (their held tickets
            # then fill it while they wait for a push: a released ticket must still reach one of them)
            for slots, seeds in ((None, range(8)), (1, range(4)), (2, range(4))):
                for seed in seeds:
                    out = _simulate(seed, k=k, j=j, B=B, workers=workers, s=s, p_skip=0.3, slots=slots)
                    assert out["trained"] == 30 * B
                    assert max(out["lags"]) <= k, (s, j, slots, seed)
                    assert out["stats"]["dropped_stale"] == 0, (s, j, slots, seed)


def test_a_dropped_stale_ticket_is_released_at_once_not_after_the_take_timeout():
    """A stale group that is the lowest outstanding ticket: ``take`` returns at once so its release (run outside the
    buffer's lock) can hand the ticket out again; it used to wait the whole timeout for that very ticket."""
    import time

    import numpy as np

    from asyncppo.stream.records import Sample, TrajectoryGroup

    ctrl = AdmissionController(1, 1)
    buf = StalenessBuffer(1, 64, order=ctrl, on_take=lambda g: ctrl.consumed(g.ticket),
                          on_drop=lambda g: ctrl.release(g.ticket))
    assert [ctrl.try_acquire().index, ctrl.try_acquire().index] == [0, 1]
    ctrl.set_version(2)
    sample = Sample(np.zeros(3, np.int32), np.zeros(3, np.float32), 0.0, "length", 0, 0)
    assert buf.put(TrajectoryGroup("0-0", 0, np.zeros(2, np.int32), [sample], ticket=0))  # lag 2 > k = 1
    t0 = time.monotonic()
    assert buf.take(1, 2, timeout_s=5.0) == []
    assert time.monotonic() - t0 < 1.0 and not ctrl.is_outstanding(0) and buf.stats()["dropped_stale"] == 1
    assert ctrl.try_acquire() == Ticket(0, 1)  # granted again, for the batch it is now trained in


def test_a_regrant_counts_the_groups_of_the_current_batch_already_trained():
    """B = 4, k = j = 1 at version 1: batch 1 kept tickets 4, 5 and 6 and skipped 7 (granted again for batch 1);
    then ticket 10's group is refused and 10 granted again. Ahead of it are 7, 8 and 9 and the three trained groups
    of batch 1, so it is trained in batch 2 and needs weights 1 (counting only the outstanding ones put it in
    batch 1: min_version 0, deadline 1, and the guard would drop its group trained at version 2)."""
    c = AdmissionController(4, 1)
    assert [c.try_acquire().index for _ in range(8)] == list(range(8))
    for i in range(4):
        c.consumed(i)
    c.set_version(1)
    assert [t.index for t in [c.try_acquire() for _ in range(4)]] == [8, 9, 10, 11]
    for i in (4, 5, 6):
        c.consumed(i)
    assert c.release(7) and c.try_acquire() == Ticket(7, 0)  # the rest of batch 1
    assert c.release(10) and c.try_acquire() == Ticket(10, 1) and c.deadline_of(10) == 2
