"""How many groups the rollout worker admits for a number of free engine slots (rollout.admission_unit)."""

import pytest

from asyncppo.config.choices import admission_room


@pytest.mark.parametrize("free, n, group, slot", [
    (0, 8, 0, 0), (-3, 8, 0, 0),  # full (or over-full: queued samples) engine: nothing
    (1, 8, 0, 1), (7, 8, 0, 1),   # a partial group's worth: only per slot
    (8, 8, 1, 1), (9, 8, 1, 2), (16, 8, 2, 2), (17, 8, 2, 3),
    (5, 1, 5, 5),                 # groups of one: the two agree
])
def test_admission_room_by_unit(free, n, group, slot):
    assert admission_room(free, n, "group") == group
    assert admission_room(free, n, "slot") == slot


def test_slot_admission_queues_fewer_than_a_group():
    """Per slot, the samples left waiting in the engine's queue never reach a whole group."""
    for n in (1, 2, 4, 8):
        for free in range(1, 40):
            queued = admission_room(free, n, "slot") * n - free
            assert 0 <= queued < n
