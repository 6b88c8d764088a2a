"""envs/env_runner.py's health, what the launcher's hang watch reads of a text-environment pool (launch/hang.py,
rule 6), on real threads and event loops: a pool whose calls all hang shows calls stuck past their deadline and time
waited with nothing returned; a slow environment that answers late, a worker idle with a leftover stuck call and a
pool that hangs some calls and answers others do not."""

from __future__ import annotations

import threading
import time

from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.examples import GuessEnv
from asyncppo.launch.hang import Seen, judge

RELEASE = threading.Event()  # set at the end of each test: the hung calls return, their threads end


class HangingEnv(GuessEnv):
    """A blocking step that never returns (until the test lets it go)."""

    def step(self, action):
        RELEASE.wait(60)
        return super().step(action)


class BlockingLoopEnv(GuessEnv):
    """A coroutine step that blocks its event loop (``time.sleep`` where it should ``await``)."""

    async def step(self, action):
        deadline = time.monotonic() + 60
        while not RELEASE.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().step(action)


class SlowEnv(GuessEnv):
    """A blocking step that answers after ``latency_s``, past its deadline."""

    def step(self, action):
        time.sleep(self.env_config["latency_s"])
        return super().step(action)


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_pool_whose_calls_all_hang_reports_stuck_calls_and_growing_unanswered_time():
    RELEASE.clear()
    try:
        with EnvRunner(max_concurrency=2, step_timeout_s=0.3) as runner:
            assert runner.health() == {"stuck": 0, "unanswered_s": 0.0, "returned": 0}
            futs = [runner.start(HangingEnv({}, {"target": 3}), "step", "1") for _ in range(2)]
            assert all(f.result(timeout=5).fault == "timeout" for f in futs)  # the deadlines fired
            # both pool threads are held by calls past their deadline; a new call queues behind them
            runner.start(HangingEnv({}, {"target": 3}), "step", "1")
            time.sleep(0.2)
            h = runner.health()
            assert h["stuck"] == 2 and h["returned"] == 0 and h["unanswered_s"] > 0.4
            seen = Seen(started_at=0.0)
            seen.answer(10.0, "generating", 100, env=h)
            assert judge(seen, 10.1, hang_s=0.4, grace_s=600).rule == "environment"
            RELEASE.set()  # the environment answers again: stuck calls return, the clock resets
            _wait_for(lambda: runner.health()["stuck"] == 0)
            h = runner.health()
            assert h["returned"] >= 2 and h["unanswered_s"] < 0.2
    finally:
        RELEASE.set()


def test_a_coroutine_that_blocks_the_loop_shows_as_a_stuck_loop():
    RELEASE.clear()
    try:
        with EnvRunner(max_concurrency=4, step_timeout_s=0.3) as runner:
            fut = runner.start(BlockingLoopEnv({}, {"target": 3}), "step", "1")
            assert fut.result(timeout=5).fault == "timeout"
            _wait_for(lambda: runner.health()["stuck"] == 1)  # the loop itself, blocked past a deadline
            # the next coroutine call moves to a fresh loop, where the same environment blocks again
            fut = runner.start(BlockingLoopEnv({}, {"target": 3}), "step", "1")
            assert fut.result(timeout=5).fault == "timeout"
            _wait_for(lambda: runner.health()["stuck"] == 2)  # the old loop, given up, and the new one, blocked
            h = runner.health()
            assert runner.loops_replaced == 1 and h["returned"] == 0 and h["unanswered_s"] >= 0.5
    finally:
        RELEASE.set()


def test_a_slow_environment_answering_late_resets_the_clock():
    with EnvRunner(max_concurrency=2, step_timeout_s=0.2) as runner:
        out = runner.start(SlowEnv({"latency_s": 0.5}, {"target": 3}), "step", "1").result(timeout=5)
        assert out.fault == "timeout"
        assert runner.health()["stuck"] == 1
        _wait_for(lambda: runner.health()["returned"] == 1)  # it did answer, late
        h = runner.health()
        assert h["stuck"] == 0 and h["unanswered_s"] == 0.0


def test_idle_time_with_a_leftover_stuck_call_does_not_count():
    RELEASE.clear()
    try:
        with EnvRunner(max_concurrency=4, step_timeout_s=0.2) as runner:
            assert runner.start(HangingEnv({}, {"target": 3}), "step", "1").result(timeout=5).fault == "timeout"
            after_deadline = runner.health()["unanswered_s"]
            time.sleep(0.6)  # no call asked meanwhile (the worker waits for admission): the clock stands
            h = runner.health()
            assert h["stuck"] == 1 and h["unanswered_s"] == after_deadline
            # another call that answers resets it: a pool that hangs some calls and answers others is not hung
            assert runner.step(GuessEnv({}, {"target": 3}), "1").fault is None
            h = runner.health()
            assert h["stuck"] == 1 and h["returned"] == 1 and h["unanswered_s"] < 0.1
    finally:
        RELEASE.set()


def test_the_episode_worker_reports_its_pool_in_the_heartbeat():
    from asyncppo.envs.episode_worker import EpisodeRolloutWorker

    worker = EpisodeRolloutWorker.__new__(EpisodeRolloutWorker)  # the heartbeat reads three fields and the runner
    worker.phase, worker.progress, worker.incarnation = "generating", 7, 0
    assert "env" not in worker.heartbeat()  # the workload has not opened yet
    with EnvRunner(max_concurrency=2, step_timeout_s=1.0) as runner:
        worker.runner = runner
        assert worker.heartbeat() == {"phase": "generating", "progress": 7, "incarnation": 0,
                                      "env": {"stuck": 0, "unanswered_s": 0.0, "returned": 0}}
