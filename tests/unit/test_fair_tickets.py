"""The ticket grant rule between rollout workers (staleness/fairness.py), as pure logic: max-min fair by tickets
held, under the per-connection cap, never more than the free capacity."""

import random

import pytest

from asyncppo.staleness.fairness import HoldingClock, allocate, auto_ticket_cap, next_holder, startup_cap


def test_two_workers_by_hand():
    # 8 free tickets, both want 32, neither holds any: 4 each; the earlier of equals gets the odd one
    assert allocate({"a": 32, "b": 32}, {}, 8) == {"a": 4, "b": 4}
    assert allocate({"a": 32, "b": 32}, {}, 7) == {"a": 4, "b": 3}
    # "a" came up first and holds the whole pool: every freed ticket goes to "b" until they are even
    assert allocate({"a": 32, "b": 32}, {"a": 8}, 4) == {"a": 0, "b": 4}
    assert allocate({"a": 32, "b": 32}, {"a": 8, "b": 4}, 6) == {"a": 1, "b": 5}
    # a worker asking little gets all it asks; the rest goes to the other
    assert allocate({"a": 2, "b": 30}, {}, 8) == {"a": 2, "b": 6}
    # the per-connection cap stays hard: with a cap of 3 each, two of the 8 free tickets stay free
    assert allocate({"a": 32, "b": 32}, {}, 8, cap=3) == {"a": 3, "b": 3}
    assert allocate({"a": 32, "b": 32}, {"b": 2}, 8, cap=3) == {"a": 3, "b": 1}
    assert allocate({"a": 1, "b": 1}, {"a": 3, "b": 3}, 8, cap=3) == {"a": 0, "b": 0}


def test_next_holder_prefers_fewest_held_then_oldest_request():
    assert next_holder(["b", "a"], {"a": 1, "b": 1}) == "b"
    assert next_holder(["b", "a"], {"a": 0, "b": 1}) == "a"
    assert next_holder(["b", "a"], {"a": 2, "b": 2}, cap=2) is None
    assert next_holder([], {}) is None


@pytest.mark.parametrize("seed", range(200))
def test_random_demands_and_capacities(seed):
    rng = random.Random(seed)
    workers = list(range(rng.randint(1, 5)))
    wants = {w: rng.choice([0, 1, 2, rng.randint(0, 70)]) for w in workers}
    held = {w: rng.randint(0, 6) for w in workers}
    free = rng.randint(0, 80)
    cap = rng.choice([None, rng.randint(1, 40)])
    got = allocate(wants, held, free, cap)
    # never more than the free capacity, than a worker asked for, or than its cap
    assert sum(got.values()) <= free
    assert all(0 <= got[w] <= wants[w] for w in workers)
    if cap is not None:
        assert all(held[w] + got[w] <= max(cap, held[w]) for w in workers)
    # work-conserving: capacity is left over only when every asker is satisfied or capped
    if sum(got.values()) < free:
        assert all(got[w] == wants[w] or (cap is not None and held[w] + got[w] >= cap) for w in workers)
    # max-min: a worker still waiting after the split holds no more than one ticket above anyone who got some
    after = {w: held[w] + got[w] for w in workers}
    for w in workers:
        if got[w] < wants[w] and (cap is None or after[w] < cap):
            assert all(after[w] >= after[u] - 1 for u in workers if got[u] > 0), (wants, held, free, cap, got)


@pytest.mark.parametrize("seed", range(50))
def test_two_greedy_workers_differ_by_at_most_one(seed):
    rng = random.Random(seed)
    capacity = rng.randint(2, 64)
    wants = {0: rng.randint(capacity // 2 + 1, 300), 1: rng.randint(capacity // 2 + 1, 300)}
    got = allocate(wants, {}, capacity)
    assert sum(got.values()) == capacity and abs(got[0] - got[1]) <= 1


@pytest.mark.parametrize("seed", range(30))
def test_no_worker_starves_over_time(seed):
    """A clocked simulation: each worker keeps asking for all its engine's free slots, every held ticket's group
    arrives after a random number of steps, capacity grows by B per learner step (consumed tickets keep their
    slot). An idle worker that asks is served within as many steps as there are workers, and over the run a
    worker asking for at least an equal share gets about one."""
    rng = random.Random(seed)
    n_workers, B, k = rng.randint(2, 4), rng.randint(1, 8), rng.randint(0, 2)
    room = {w: rng.choice([B, 4 * B, 64]) for w in range(n_workers)}  # free engine slots, in groups
    held = {w: [] for w in range(n_workers)}  # remaining generation steps of each held ticket
    granted = {w: 0 for w in range(n_workers)}
    idle_waits = {w: 0 for w in range(n_workers)}  # steps asked while holding nothing, unserved
    live = 0
    for step in range(60):
        capacity = (k + step + 1) * B
        for w in held:
            held[w] = [t - 1 for t in held[w] if t > 1]
        wants = {w: room[w] - len(held[w]) for w in held}
        order = sorted(wants, key=lambda w: -idle_waits[w])  # the server breaks ties by the oldest request
        got = allocate({w: wants[w] for w in order}, {w: len(h) for w, h in held.items()}, capacity - live)
        for w, n in got.items():
            held[w] += [rng.randint(1, 4) for _ in range(n)]
            granted[w] += n
            live += n
            idle_waits[w] = idle_waits[w] + 1 if not held[w] and wants[w] > 0 else 0
            assert idle_waits[w] <= n_workers, f"idle worker {w} asked for {wants[w]}, unserved for a while"
        assert live <= capacity
    fair = sum(granted.values()) / n_workers
    for w in held:
        assert granted[w] >= min(fair, room[w] * 60 / 4) * 0.5, (room, granted)


def test_holding_clock_by_hand():
    now = [0.0]
    c = HoldingClock(clock=lambda: now[0])
    c.seen(0)
    c.add(0, +2)          # t=0: worker 0 busy
    now[0] = 1.0
    c.seen(1)             # t=1: worker 1 asks, waits
    now[0] = 3.0
    c.add(1, +1)          # t=3: worker 1 busy
    c.add(0, -2)          # t=3: worker 0 idle
    now[0] = 5.0
    c.freeze()            # t=5: admission stops
    now[0] = 100.0
    assert c.busy_fractions() == {0: 3 / 5, 1: 2 / 4}


def test_startup_cap_reserves_an_equal_share_until_every_worker_has_asked():
    # window (k + 1) * B = 8, two workers expected: the first to ask may hold 4 until the second asks
    assert startup_cap(8, 2, asked=1, cap=None) == 4
    assert allocate({"a": 32}, {}, 8, cap=startup_cap(8, 2, 1, None)) == {"a": 4}
    assert startup_cap(8, 2, asked=2, cap=None) is None
    assert startup_cap(9, 2, asked=1, cap=3) == 3  # the hard cap still binds
    assert startup_cap(9, 2, asked=1, cap=None) == 5
    assert startup_cap(1, 4, asked=0, cap=None) == 1  # never below one ticket
    assert startup_cap(8, None, asked=0, cap=7) == 7


def test_auto_ticket_cap_by_hand():
    # single-turn: twice the groups the engine has room for, plus two (64 slots / 8 samples = 8 groups -> 18)
    assert auto_ticket_cap(64, 8, 1, window=36, episodes=False) == 18
    assert auto_ticket_cap(256, 4, 1, window=36, episodes=False) == 130  # above the window: the window binds
    assert auto_ticket_cap(8, 16, 4, window=36, episodes=False) == 10  # a batch engine's prompts_per_call
    # episodes: the staleness window, whatever the engine's slots (a worker behind a slow tool keeps ~1/share x
    # room groups in flight), still split evenly by the max-min rule when several workers want more
    assert auto_ticket_cap(64, 8, 1, window=36, episodes=True) == 36
    assert auto_ticket_cap(64, 8, 1, window=0, episodes=True) == 1
    assert allocate({"a": 40, "b": 40}, {}, 36, cap=auto_ticket_cap(64, 8, 1, 36, True)) == {"a": 18, "b": 18}
