"""One weight-sync group per worker (sync/fanout.py), with real gloo groups in separate processes: a worker killed
with SIGKILL breaks nobody else's pushes, its replacement receives the current weights before anything else, and a
worker that does not take a push is named within the timeout."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from asyncppo.sync import SyncGroupError, WeightReceiver, find_free_port, make_sync_group
from asyncppo.sync.fanout import WeightFanout, member_prefix

PREFIX = "test-run"


def _receiver(worker: int, incarnation: int, port: int, versions: int, out, hang: bool = False) -> None:
    """Join as worker ``worker`` (incarnation ``incarnation``), receive ``versions`` pushes, report what arrived."""
    torch.set_num_threads(1)
    out.put(("ready", worker))  # imports done: the test forms rank 0's side only now (short timeouts)
    group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=60,
                            store_prefix=member_prefix(PREFIX, worker, incarnation))
    receiver = WeightReceiver(group)
    for _ in range(versions):
        version, tensors = receiver.receive()
        out.put((worker, incarnation, version, float(dict(tensors)["w"][0])))
        if hang:
            time.sleep(3600)
    group.close()


def _weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1000,), float(version)), "b": torch.arange(10, dtype=torch.float64) * version}


def _big(version: int) -> dict[str, torch.Tensor]:
    """24 MiB of weights: more than the sockets' buffers absorb, so a push to a stopped process blocks."""
    return {"w": torch.full((6 << 20,), float(version)), "b": torch.zeros(10, dtype=torch.float64)}


def _queues(ctx) -> dict:
    """One report queue per worker. Not one shared queue: its writers share a lock, and a worker stopped or killed
    between writing a report and releasing that lock would leave the other's next report stuck behind it."""
    return {w: ctx.Queue() for w in (0, 1)}


def _got(outs: dict, workers, timeout: float = 60.0) -> list[tuple]:
    return sorted(outs[w].get(timeout=timeout) for w in workers)


def _start_two(ctx, fanout: WeightFanout, port: int, outs: dict) -> dict:
    """Workers 0 and 1 (incarnation 0), each receiving 3 versions, joined to ``fanout``."""
    procs = {}
    for w in (0, 1):
        fanout.add(w, 0)
        procs[w] = ctx.Process(target=_receiver, args=(w, 0, port, 3, outs[w]))
        procs[w].start()
    assert _got(outs, (0, 1), timeout=120) == [("ready", 0), ("ready", 1)]
    fanout.wait_joined([0, 1])
    return procs


def test_a_killed_member_breaks_nobody_and_its_replacement_gets_the_current_weights():
    ctx = mp.get_context("spawn")
    outs = _queues(ctx)
    port = find_free_port()
    fanout = WeightFanout("127.0.0.1", port, PREFIX, timeout_s=60)
    procs = {}
    try:
        procs.update(_start_two(ctx, fanout, port, outs))
        fanout.push_async(_weights(1), 1)
        fanout.wait()
        assert _got(outs, (0, 1)) == [(0, 0, 1, 1.0), (1, 0, 1, 1.0)]
        # once a member took its first push its rendezvous keys are gone: a stranger who reaches the store and
        # lists its keys learns nothing of the run's secret prefix (docs/security.md, "Across two hosts")
        assert not [k for k in fanout.store.list_keys() if PREFIX in k], fanout.store.list_keys()
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join()
        t0 = time.monotonic()
        fanout.push_async(_weights(2), 2)
        fanout.wait()  # the dead member's push fails at once and retires it: no error, no timeout
        assert time.monotonic() - t0 < 30
        assert _got(outs, (0,)) == [(0, 0, 2, 2.0)]
        assert len(fanout.failures) == 1 and "rollout worker 1 (incarnation 0)" in fanout.failures[0]
        assert not fanout.late and fanout.ready() == [0]
        # the replacement (incarnation 1) joins later and is handed the newest weights first, then later pushes
        fanout.replace(1, 1)
        outs[1] = ctx.Queue()  # the killed member may have died holding its queue's lock
        procs[1] = ctx.Process(target=_receiver, args=(1, 1, port, 2, outs[1]))
        procs[1].start()
        assert outs[1].get(timeout=120) == ("ready", 1)
        fanout.wait_joined([1])
        assert _got(outs, (1,)) == [(1, 1, 2, 2.0)]
        fanout.push_async(_weights(3), 3)
        fanout.wait()
        assert _got(outs, (0, 1)) == [(0, 0, 3, 3.0), (1, 1, 3, 3.0)]
        assert fanout.versions() == {0: 3, 1: 3}
    finally:
        fanout.close()
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()


def test_a_member_that_does_not_take_a_push_is_named_within_the_timeout():
    ctx = mp.get_context("spawn")
    outs = _queues(ctx)
    port = find_free_port()
    fanout = WeightFanout("127.0.0.1", port, PREFIX, timeout_s=5)
    procs = []
    try:
        for w, hang in ((0, False), (1, True)):  # worker 1 takes version 1, then stops taking anything
            procs.append(ctx.Process(target=_receiver, args=(w, 0, port, 2, outs[w], hang)))
            procs[-1].start()
        assert _got(outs, (0, 1), timeout=120) == [("ready", 0), ("ready", 1)]
        for w in (0, 1):
            fanout.add(w, 0)
        fanout.wait_joined([0, 1], timeout_s=60)
        fanout.push_async(_weights(1), 1)
        fanout.wait()
        assert _got(outs, (0, 1)) == [(0, 0, 1, 1.0), (1, 0, 1, 1.0)]
        fanout.push_async(_weights(2), 2)
        t0 = time.monotonic()
        with pytest.raises(SyncGroupError, match=r"rollout worker.* 1 .*cluster.timeout_s"):
            fanout.wait()
        assert 4 < time.monotonic() - t0 < 20
        assert _got(outs, (0,)) == [(0, 0, 2, 2.0)]  # the prompt member was served meanwhile
    finally:
        fanout.close()
        for p in procs:
            p.kill()
            p.join()


def test_a_stopped_member_misses_the_push_deadline_and_the_others_are_served_in_time():
    """SIGSTOP one receiver between two pushes: the next push is too large for the sockets' buffers to absorb, so its
    broadcast to the stopped process blocks. ``retire_late`` retires that member at the push deadline and names it;
    the other member loaded the new weights meanwhile, and nothing waits for the group timeout (60 s here)."""
    ctx = mp.get_context("spawn")
    outs = _queues(ctx)
    port = find_free_port()
    fanout = WeightFanout("127.0.0.1", port, PREFIX, timeout_s=60)
    procs = {}
    try:
        procs.update(_start_two(ctx, fanout, port, outs))
        fanout.push_async(_big(1), 1)
        assert fanout.retire_late(30) == []  # both took version 1 within the deadline
        assert _got(outs, (0, 1)) == [(0, 0, 1, 1.0), (1, 0, 1, 1.0)]
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        fanout.push_async(_big(2), 2)
        assert outs[0].get(timeout=30) == (0, 0, 2, 2.0)  # the running member loaded version 2 ...
        served = time.monotonic() - t0
        # ... and the stopped one is cut off at the deadline, not the timeout. The learner asks a step after the push
        # started: the deadline counts from the push (it counted from the call, 3 + 5 s here, before)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        retired = fanout.retire_late(5)
        waited = time.monotonic() - t0
        print(f"worker 0 served after {served:.2f}s; worker 1 retired after {waited:.2f}s")
        assert served < 3 and 5 <= waited < 7.5, (served, waited)
        assert len(retired) == 1 and "rollout worker 1 (incarnation 0)" in retired[0]
        assert "cluster.push_timeout_s" in retired[0] and "last took v1" in retired[0]
        assert [(w, g) for w, g, _ in fanout.hung] == [(1, 0)]
        assert fanout.ready() == [0] and fanout.versions() == {0: 2}
        fanout.push_async(_big(3), 3)  # later pushes go to the live member alone, without waiting
        assert fanout.retire_late(30) == [] and outs[0].get(timeout=30) == (0, 0, 3, 3.0)
    finally:
        fanout.close()
        for p in procs.values():
            p.kill()  # SIGKILL ends a stopped process too
            p.join()


def test_a_worker_that_never_joins_is_named():
    fanout = WeightFanout("127.0.0.1", find_free_port(), PREFIX, timeout_s=2)
    try:
        fanout.add(0, 0)
        with pytest.raises(SyncGroupError, match=r"rollout worker\(s\) \[0\] did not join"):
            fanout.wait_joined([0], timeout_s=10)
    finally:
        fanout.close()


def test_an_overdue_push_is_retired_without_waiting_while_the_learner_waits_for_a_batch():
    """``retire_overdue`` (called by the learner while it waits for a batch, which may need the late worker's own
    groups) never waits: nothing is overdue before the push deadline, counted from the push; the stopped member is
    retired by the first call after it; the live member is never touched."""
    ctx = mp.get_context("spawn")
    outs = _queues(ctx)
    port = find_free_port()
    fanout = WeightFanout("127.0.0.1", port, PREFIX, timeout_s=60)
    procs = {}
    try:
        procs.update(_start_two(ctx, fanout, port, outs))
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        fanout.push_async(_big(1), 1)
        assert outs[0].get(timeout=30) == (0, 0, 1, 1.0)
        calls = 0
        while True:
            c0 = time.monotonic()
            retired = fanout.retire_overdue(3)
            assert time.monotonic() - c0 < 0.5  # never waits
            calls += 1
            if retired or time.monotonic() - t0 > 20:
                break
            time.sleep(0.1)
        waited = time.monotonic() - t0
        assert 3 <= waited < 5 and calls > 5, (waited, calls)
        assert len(retired) == 1 and "rollout worker 1 (incarnation 0)" in retired[0]
        assert fanout.ready() == [0] and fanout.retire_overdue(3) == []
    finally:
        fanout.close()
        for p in procs.values():
            p.kill()
            p.join()
