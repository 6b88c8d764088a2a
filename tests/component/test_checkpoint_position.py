"""The data position a checkpoint or a worker replacement resumes from (data/position.py), and the admission side of a
replacement: a dead worker's tickets and parked requests are taken back (AdmissionServer.retire, real sockets)."""

from __future__ import annotations

import io
import random
import time

import torch

from asyncppo.data.position import DataPosition, resume_draws
from asyncppo.stream.group_ids import group_key, parse_key
from asyncppo.staleness import AdmissionClient, AdmissionController, AdmissionServer


def test_group_keys_name_worker_and_draw_in_every_incarnation():
    assert group_key(3, 0, 17) == "3-17" and group_key(3, 2, 17) == "3.2-17"
    assert parse_key("3-17") == (3, 17) and parse_key("3.2-17") == (3, 17)
    for bad in ("", "x-1", "3-", "-4", "3.2", "eval-0-1x"):
        assert parse_key(bad) is None, bad


def test_position_tracks_the_lowest_untrained_draw_and_the_trained_ones_above():
    pos = DataPosition()
    for key in ("0-0", "0-2", "0-3", "1.1-0", "junk"):
        pos.record(key)
    assert pos.of(0) == {"next": 1, "done": [2, 3]}
    assert pos.of(1) == {"next": 1, "done": []}
    assert pos.of(7) == {"next": 0, "done": []}
    pos.record("0-1")
    pos.record("0-1")  # a repeat changes nothing
    assert pos.of(0) == {"next": 4, "done": []}


def test_position_survives_the_checkpoint_file_format():
    pos = DataPosition()
    for key in ("0-0", "0-1", "0-5", "2-3"):
        pos.record(key)
    buf = io.BytesIO()
    torch.save({"extra": {"data_position": pos.state_dict()}}, buf)
    buf.seek(0)
    loaded = DataPosition(torch.load(buf, weights_only=True)["extra"]["data_position"])
    assert loaded.state_dict() == pos.state_dict() == {0: {"next": 2, "done": [5]}, 2: {"next": 0, "done": [3]}}


def test_resumed_draws_are_exactly_the_untrained_ones_in_order():
    rng = random.Random(0)
    sequence = [f"prompt{i}" for i in range(200)]
    for _ in range(20):
        drawn = rng.randrange(1, 120)
        trained = sorted(rng.sample(range(drawn), rng.randrange(0, drawn)))
        pos = DataPosition()
        for seq in rng.sample(trained, len(trained)):  # groups finish in any order
            pos.record(group_key(0, 0, seq))
        resumed = resume_draws(iter(sequence), pos.of(0))
        untrained = [s for s in range(200) if s not in set(trained)]
        got = [next(resumed) for _ in range(len(untrained))]
        assert got == [(s, sequence[s]) for s in untrained]


def test_retire_returns_a_dead_workers_tickets_and_drops_its_parked_requests():
    controller = AdmissionController(batch_groups=2, max_staleness=0)  # 2 tickets at version 0
    server = AdmissionServer(controller, "tcp://127.0.0.1:0")
    dead = AdmissionClient(server.address, worker_id=1)
    try:
        got = [dead.acquire(timeout_s=10), dead.acquire(timeout_s=10)]
        assert [t.index for t in got] == [0, 1]
        dead.request(1)  # parked: the pool is empty at version 0
        deadline = time.monotonic() + 10
        while server.num_pending == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.num_pending == 1
        assert server.retire(1) == [0, 1]
        assert server.num_pending == 0 and server.held_by(1) == []
        assert controller.stats()["in_flight"] == 0 and controller.stats()["released"] == 2
        # the replacement (same worker id, new connection) is granted the returned slots, lowest first
        replacement = AdmissionClient(server.address, worker_id=1)
        try:
            assert [replacement.acquire(timeout_s=10).index for _ in range(2)] == [0, 1]
            assert server.held_by(1) == [0, 1]
            # retiring the replacement in turn returns them, and a group arriving late for a returned ticket is
            # refused at the door (the ticket is no longer anyone's)
            assert server.retire(1) == [0, 1] and server.claim(0, 1, 0) == "ticket"
        finally:
            replacement.close()
    finally:
        dead.close()
        server.close()
