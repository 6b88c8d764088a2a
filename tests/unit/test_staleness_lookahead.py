"""Admission lookahead ``j <= k`` and deadline-aware consumption: the grant window and deadlines by hand, one
deferral worked through, and out-of-order consumption as a property over random lengths, push times and workers.

The property simulation drives the real :class:`AdmissionController` and ticket-ordered :class:`StalenessBuffer`
single-threaded on a tick clock (no sockets): ``W`` workers each hold an engine with weights of version ``w_i``
that loads an announced push after a random delay of its own; each worker keeps up to ``slots`` groups in flight,
starts a granted group once ``w_i >= min_version`` (lowest index first, as the rollout worker does), generates one token per tick with a heavy-tailed length and
stamps every token with ``w_i`` at that tick (``keep`` updates); the learner takes ``B`` groups whenever it is free,
trains for a random number of ticks, bumps the version and announces it. Asserted: every trained token's lag is
``<= k`` and every group is trained by its deadline; nothing is dropped; every granted ticket is trained once (after
admission stops, the run drains); with ``j = k`` the consumed order is exactly ticket order; with ``j < k`` the lag
is lower than with ``j = k`` on the same seeds, and groups are actually trained ahead of stragglers.
"""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from asyncppo.staleness import AdmissionController, StalenessBuffer, Ticket
from asyncppo.staleness.order import take_startable
from asyncppo.stream.records import Sample, TrajectoryGroup, spans_from_token_versions


def _group(ticket: int, versions: list[int]) -> TrajectoryGroup:
    v = np.asarray(versions, dtype=np.int64)
    sample = Sample(np.zeros(len(v), np.int32), np.zeros(len(v), np.float32), 0.0, "length", int(v.min()),
                    int(v.max()), version_spans=spans_from_token_versions(v))
    return TrajectoryGroup(f"g{ticket}", 0, np.zeros(2, np.int32), [sample], ticket=ticket)


def worker_tick(w: dict, tick: int, ctrl, buf, rng, slots: int, deadlines: dict | None = None) -> None:
    """One tick of a simulated worker ``w`` (``version``, ``loads``, ``pending`` deque, ``flights``): take the loads
    due, ask for tickets while it has room (one more while all it holds wait for a push not announced yet), start what its weights
    allow as the rollout worker does
    (:func:`take_startable`), stamp one token of every group in flight with its weights, send the finished ones."""
    w["version"] = max([w["version"], *(u for at, u in w["loads"] if at <= tick)])
    grants = []
    while len(w["flights"]) + len(w["pending"]) + len(grants) < slots and (t := ctrl.try_acquire()) is not None:
        grants.append(t)
    # while every held ticket waits for a push not announced yet, one request stays open beyond the room
    # (rollout/worker.py _admit); a push is announced when it is made, and loaded after the worker's delay
    announced = max([w["version"], *(u for _, u in w["loads"])])
    if not grants and w["pending"] and not any(t.min_version <= announced for t in w["pending"]):
        grants += [t] if (t := ctrl.try_acquire()) is not None else []
    for t in grants:
        if deadlines is not None:
            deadlines[t.index] = ctrl.deadline_of(t.index)
        w["pending"].append(t)
    while (t := take_startable(w["pending"], w["version"])) is not None:
        # heavy tail: most groups short, a few many learner steps long
        w["flights"].append((t.index, max(2, min(120, int(rng.lognormvariate(2.0, 1.0)))), []))
    for f in list(w["flights"]):
        f[2].append(w["version"])
        if len(f[2]) == f[1]:
            w["flights"].remove(f)
            assert buf.put(_group(f[0], f[2]), timeout_s=0)


def _pair(B: int, k: int, j: int | None, total_slots: int | None = None):
    ctrl = AdmissionController(B, k, lookahead=j, total_slots=total_slots)
    buf = StalenessBuffer(k, capacity_groups=(k + 2) * B + 64, order=ctrl,
                          on_drop=lambda g: ctrl.release(g.ticket), on_take=lambda g: ctrl.consumed(g.ticket))
    return ctrl, buf


def _drain(ctrl) -> list[Ticket]:
    out = []
    while (t := ctrl.try_acquire()) is not None:
        out.append(t)
    return out


# ------------------------------------------------------------------------------------------------ by hand
def test_grant_window_min_version_and_deadlines_by_hand():
    c = AdmissionController(batch_groups=2, max_staleness=3, lookahead=1)
    # v = 0: live < (1 + 0 + 1) * 2 = 4; min_version = max(0, i // 2 - 1) = 0; deadline i // 2 - 1 + 3
    assert _drain(c) == [Ticket(i, 0) for i in range(4)]
    assert [c.deadline_of(i) for i in range(4)] == [2, 2, 3, 3]
    c.set_version(1)  # live < 6: tickets 4, 5 need weights 4 // 2 - 1 = 1; deadline 1 + 3 = 4
    assert _drain(c) == [Ticket(4, 1), Ticket(5, 1)]
    assert c.deadline_of(4) == 4 and c.capacity() == 6 and c.window() == 4
    c.consumed(0)
    assert c.deadline_of(0) is None  # only outstanding tickets have a deadline
    # j = k is the rule without a lookahead: deadline = the slot's version, and nothing is ever deferred
    d = AdmissionController(batch_groups=2, max_staleness=3)
    assert _drain(d) == [Ticket(i, 0) for i in range(8)] and [d.deadline_of(i) for i in range(8)] == [
        0, 0, 1, 1, 2, 2, 3, 3]
    assert d.can_defer([2, 3], 0) is False


@pytest.mark.parametrize("bad", [-1, 4, 1.0, "2"])
def test_lookahead_outside_zero_to_k_is_refused(bad):
    with pytest.raises(ValueError, match="lookahead"):
        AdmissionController(2, 3, lookahead=bad)


def test_a_missing_ticket_with_slack_is_deferred_and_waited_for_at_its_deadline():
    """B=2, k=3, j=1. Ticket 0 (deadline 2) straggles: versions 0 and 1 train the next arrived tickets instead,
    version 2 waits for it and trains it with lag 2 <= k."""
    ctrl, buf = _pair(2, 3, 1)
    _drain(ctrl)  # 0..3
    for t in (1, 2, 3):
        buf.put(_group(t, [0]))
    assert [g.ticket for g in buf.take(2, 0, timeout_s=0)] == [1, 2]  # 0 missing, deadline 2 > 0: deferred
    assert buf.stats()["deferred"] == 1
    ctrl.set_version(1)
    assert _drain(ctrl) == [Ticket(4, 1), Ticket(5, 1)]
    buf.put(_group(4, [1]))
    assert [g.ticket for g in buf.take(2, 1, timeout_s=0)] == [3, 4]  # 0 still has slack (deadline 2 > 1)
    ctrl.set_version(2)
    assert _drain(ctrl) == [Ticket(6, 2), Ticket(7, 2)]
    buf.put(_group(5, [1]))
    buf.put(_group(6, [2]))
    assert buf.take(2, 2, timeout_s=0) == []  # ticket 0 is at its deadline: the learner waits for it
    assert buf.missing(2) == [0]
    buf.put(_group(0, [0, 1, 2]))
    batch = buf.take(2, 2, timeout_s=0)
    assert [g.ticket for g in batch] == [0, 5] and 2 - batch[0].version_min == 2
    assert buf.stats()["deferred"] == 2 and buf.stats()["dropped_stale"] == 0


def test_can_defer_matches_a_brute_force_deadline_check():
    """The finite check (``B`` future grants past the last deadline) equals the same check over a long horizon."""
    rng = random.Random(5)
    for _ in range(300):
        B, k = rng.randint(1, 4), rng.randint(1, 5)
        j = rng.randint(0, k - 1)
        c = AdmissionController(B, k, lookahead=j)
        v = 0
        for _ in range(rng.randint(0, 6)):
            for t in _drain(c):
                if rng.random() < 0.5:
                    c.consumed(t)
            v += 1
            c.set_version(v)
        granted = _drain(c)
        outstanding = sorted(i for i in range(c.stats()["live"]) if c.is_outstanding(i))
        take = rng.sample(outstanding, min(len(outstanding), B))
        rest = sorted(c.deadline_of(i) for i in outstanding if i not in take)
        live = c.stats()["live"]
        future = [(live + m) // B - j + k for m in range(200)]
        brute = all(d >= v + -(-m // B) for m, d in enumerate(sorted(rest + future)[:150], start=1))
        assert c.can_defer(take, v) == brute, (B, k, j, v, take, outstanding, granted)


# ------------------------------------------------------------------------------------------------ property
def _simulate(seed: int, *, k: int, j: int, B: int, workers: int, steps: int, capped: bool = False) -> dict:
    """``capped``: the controller knows the run's last slot (``steps * B``), as a launch's does."""
    rng = random.Random(seed)
    ctrl, buf = _pair(B, k, j, steps * B if capped else None)
    slots = (k + 1) * B // workers + 2  # engines can hold the whole window: the learner is the slower side
    ws = [{"version": 0, "loads": [], "pending": collections.deque(), "flights": []} for _ in range(workers)]
    deadlines: dict[int, int] = {}
    v, busy, tick, waited = 0, 0, 0, 0
    trained, lags, token_lags = [], [], []
    while v < steps or ctrl.stats()["in_flight"] >= B:
        tick += 1
        assert tick < 100_000, f"seed {seed}: no progress at version {v}"
        if v == steps and not ctrl.stopped:
            ctrl.stop()  # the run ends: what was granted must still be trained (drained below)
        if busy:
            busy -= 1
            if not busy:
                v += 1
                ctrl.set_version(v)
                for w in ws:  # the push: each engine loads it after a delay of its own
                    w["loads"].append((tick + rng.choice([0, 1, 2, 3, 8]), v))
        else:
            batch = buf.take(B, v, timeout_s=0)
            if batch:
                for g in batch:
                    assert v <= deadlines[g.ticket], f"seed {seed}: ticket {g.ticket} trained after its deadline"
                    trained.append(g.ticket)
                    lags.append(v - g.version_min)
                    token_lags.extend((v - g.samples[0].token_versions()).tolist())
                busy = rng.randint(3, 10)
            else:
                waited += 1
        for w in ws:
            worker_tick(w, tick, ctrl, buf, rng, slots, deadlines)
    return {"trained": trained, "lags": lags, "token_lags": token_lags, "stats": buf.stats(), "waited": waited,
            "granted": ctrl.stats()["granted"], "left": ctrl.stats()["in_flight"]}


SEEDS = range(40)
SHAPES = [(4, 2, 1), (3, 4, 2), (2, 3, 3)]  # (k, B, workers)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"k{s[0]}-B{s[1]}-w{s[2]}" for s in SHAPES])
def test_out_of_order_consumption_never_trains_past_the_bound(shape):
    k, B, workers = shape
    mean_lag = {}
    deferred = 0
    for j in range(k + 1):
        lags = []
        for seed in SEEDS:
            out = _simulate(seed, k=k, j=j, B=B, workers=workers, steps=30)
            assert max(out["token_lags"]) <= k and max(out["lags"]) <= k, f"seed {seed} j {j}"
            assert out["stats"]["dropped_stale"] == 0 and out["stats"]["rejected_ticket"] == 0
            # every granted ticket trained exactly once (fewer than B left when admission stopped and drained)
            assert len(set(out["trained"])) == len(out["trained"]) == out["granted"] - out["left"]
            assert out["left"] < B
            if j == k:
                assert out["trained"] == list(range(len(out["trained"]))), f"seed {seed}: not ticket order"
                assert out["stats"]["deferred"] == 0
            else:
                deferred += out["stats"]["deferred"]
            lags += out["lags"]
        mean_lag[j] = float(np.mean(lags))
    assert deferred > 0  # stragglers with slack were actually overtaken
    # fresher with a smaller lookahead (the point of the option); k = j is today's rule
    assert all(mean_lag[j] < mean_lag[j + 1] for j in range(k)), mean_lag
    assert mean_lag[0] < 0.75 * mean_lag[k], mean_lag


@pytest.mark.parametrize("shape", SHAPES, ids=[f"k{s[0]}-B{s[1]}-w{s[2]}" for s in SHAPES])
def test_with_the_runs_last_slot_known_exactly_its_slots_are_granted_and_trained(shape):
    """Nothing is generated past the last step, the last batches still complete (no deadlock at the end, deferral
    included), and the bound holds."""
    k, B, workers = shape
    steps = 30
    for j in range(k + 1):
        for seed in SEEDS[:15]:
            out = _simulate(seed, k=k, j=j, B=B, workers=workers, steps=steps, capped=True)
            assert sorted(out["trained"]) == list(range(steps * B)), f"seed {seed} j {j}"
            assert out["granted"] == steps * B and out["left"] == 0
            assert max(out["token_lags"]) <= k and out["stats"]["dropped_stale"] == 0


def test_a_lookahead_keeps_the_freshness_of_a_small_bound_but_waits_less_for_stragglers():
    """``k = 4, j = 1`` against ``k = j = 1``: the same nominal lag, but a straggler with slack no longer holds up
    the learner (fewer ticks spent waiting for a batch)."""
    out = {k: [_simulate(seed, k=k, j=1, B=2, workers=1, steps=30) for seed in SEEDS] for k in (1, 4)}
    lag = {k: float(np.mean([x for o in runs for x in o["lags"]])) for k, runs in out.items()}
    waited = {k: sum(o["waited"] for o in runs) for k, runs in out.items()}
    assert abs(lag[4] - lag[1]) < 0.1, lag
    assert waited[4] < 0.8 * waited[1], waited
