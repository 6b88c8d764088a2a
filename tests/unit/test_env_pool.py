"""envs/env_runner.py's pool for blocking environments: threads start only when calls need them, up to
``env.max_concurrency``, so the auto bound (the episodes a worker may hold, up to 256) costs nothing for a fast
environment and still lets a slow one's calls wait side by side."""

from __future__ import annotations

import concurrent.futures as cf
import time

from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.examples import GuessEnv


class SleepyGuessEnv(GuessEnv):
    """The guess game whose step blocks its thread for ``latency_s`` (a synchronous tool call)."""

    def step(self, action):
        time.sleep(self.env_config.get("latency_s", 0.0))
        return super().step(action)


def test_threads_start_when_calls_need_them_and_no_more():
    with EnvRunner(max_concurrency=256, step_timeout_s=30) as runner:
        assert runner._pool.threads == 0  # nothing started for nothing
        fast = GuessEnv({}, {"target": 6})
        for _ in range(20):  # one call at a time: one thread serves them all
            assert runner.step(fast, "3").fault is None
        assert runner._pool.threads == 1
        envs = [SleepyGuessEnv({"latency_s": 0.3}, {"target": 5}) for _ in range(12)]
        with cf.ThreadPoolExecutor(12) as callers:
            t0 = time.perf_counter()
            outcomes = [f.result(timeout=30) for f in [callers.submit(runner.step, e, "1") for e in envs]]
            took = time.perf_counter() - t0
        assert all(o.fault is None for o in outcomes)
        assert took < 1.2, took  # side by side: ~0.3 s, not 12 x 0.3 s in turn
        assert 2 <= runner._pool.threads <= 13  # one each for the 12 at most, plus the one from before


def test_the_bound_still_holds():
    """4 threads at most: 8 blocking calls of 0.3 s take two rounds."""
    with EnvRunner(max_concurrency=4, step_timeout_s=30) as runner, cf.ThreadPoolExecutor(8) as callers:
        envs = [SleepyGuessEnv({"latency_s": 0.3}, {"target": 5}) for _ in range(8)]
        t0 = time.perf_counter()
        outcomes = [f.result(timeout=30) for f in [callers.submit(runner.step, e, "1") for e in envs]]
        took = time.perf_counter() - t0
        assert all(o.fault is None for o in outcomes) and runner._pool.threads == 4
    assert 0.6 <= took < 1.5, took


class LeakyGuessEnv(GuessEnv):
    """A coroutine step that leaves a task of its own running when it returns."""

    leaked: list = []

    async def step(self, action):
        import asyncio

        self.leaked.append(asyncio.get_running_loop().create_task(asyncio.sleep(60)))
        return super().step(action)


def test_coroutine_calls_run_on_one_loop_and_what_they_leave_running_ends_with_the_runner():
    with EnvRunner(max_concurrency=1, step_timeout_s=30) as runner:
        for _ in range(3):
            assert runner.step(LeakyGuessEnv({}, {"target": 6}), "3").fault is None
        loops = {t.get_loop() for t in LeakyGuessEnv.leaked}
        assert len(loops) == 1 and not next(iter(loops)).is_closed()  # one loop for every call, kept running
        assert runner._pool.threads == 0
    assert len(LeakyGuessEnv.leaked) == 3 and all(t.cancelled() for t in LeakyGuessEnv.leaked)
    assert next(iter(loops)).is_closed()


class AwaitingGuessEnv(GuessEnv):
    """A coroutine step that awaits ``latency_s`` (a remote tool), recording the thread it ran on."""

    threads: set = set()

    async def step(self, action):
        import asyncio
        import threading

        self.threads.add(threading.get_ident())
        await asyncio.sleep(self.env_config.get("latency_s", 0.0))
        return super().step(action)


def test_coroutine_calls_share_one_loop_side_by_side_and_start_no_pool_thread():
    """100 calls of 0.3 s each, all at once: one event loop thread runs them together (~0.3 s, not 100 x 0.3 s) and
    no pool thread or waiter starts; the bound of 50 makes two rounds."""
    import threading

    AwaitingGuessEnv.threads.clear()
    before = threading.active_count()
    with EnvRunner(max_concurrency=50, step_timeout_s=30) as runner:
        t0 = time.perf_counter()
        futures = [runner.start(AwaitingGuessEnv({"latency_s": 0.3}, {"target": 5}), "step", "5") for _ in range(100)]
        during = threading.active_count()
        outcomes = [f.result(timeout=30) for f in futures]
        took = time.perf_counter() - t0
        assert all(o.fault is None and o.reward == 1.0 for o in outcomes)
        assert 0.6 <= took < 2.0, took  # two rounds of 50
        assert len(AwaitingGuessEnv.threads) == 1 and runner._pool.threads == 0
        assert during - before <= 2  # the loop's thread and the deadline thread, not a thread a call


class BlockingCoroutineEnv(GuessEnv):
    """A broken coroutine environment: its step blocks the loop (``time.sleep`` where it should await)."""

    async def step(self, action):
        time.sleep(float(self.env_config["block_s"]))
        return super().step(action)


def test_a_coroutine_that_blocks_its_loop_times_out_and_later_calls_get_a_fresh_loop():
    """The deadline thread still fires while the loop is blocked: the blocking call and one queued behind it come
    back as timeouts on time, and a call started once the loop has been blocked past a deadline runs on a new
    loop; the blocked loop counts as stuck until its call returns, then ends."""
    with EnvRunner(max_concurrency=8, step_timeout_s=0.4) as runner:
        t0 = time.monotonic()
        blocking = runner.start(BlockingCoroutineEnv({"block_s": 2.0}, {"target": 5}), "step", "5")
        time.sleep(0.1)
        behind = runner.start(AwaitingGuessEnv({}, {"target": 5}), "step", "5")  # queued on the blocked loop
        assert blocking.result(timeout=5).fault == "timeout" and behind.result(timeout=5).fault == "timeout"
        assert time.monotonic() - t0 < 1.2
        time.sleep(0.3)  # the loop now blocked for longer than a deadline
        fresh = runner.start(AwaitingGuessEnv({}, {"target": 5}), "step", "5").result(timeout=5)
        assert fresh.fault is None and fresh.reward == 1.0 and time.monotonic() - t0 < 1.9
        assert runner.loops_replaced == 1 and runner.stuck == 1
        deadline = time.monotonic() + 10
        while runner.stuck and time.monotonic() < deadline:  # the blocking call returns at ~2 s; its loop ends
            time.sleep(0.05)
        assert runner.stuck == 0
        assert dict(runner.faults)["timeout"] == 2 and runner.calls == 3


def test_calls_that_answer_early_cost_the_deadline_thread_no_wake():
    """The deadline thread sleeps until the front of its queue is due and drops answered calls when it gets there:
    200 quick calls with a 60 s deadline wake it once or twice (the first call's arrival), not 200 times; a call
    that hangs is still timed out on time after them."""
    with EnvRunner(max_concurrency=4, step_timeout_s=60) as runner:
        for _ in range(200):
            assert runner.step(GuessEnv({}, {"target": 6}), "3").fault is None
        assert runner._deadlines.wakes <= 3, runner._deadlines.wakes
    with EnvRunner(max_concurrency=4, step_timeout_s=1.0) as runner:
        for _ in range(50):
            assert runner.step(GuessEnv({}, {"target": 6}), "3").fault is None
        t0 = time.monotonic()
        hung = runner.step(SleepyGuessEnv({"latency_s": 5.0}, {"target": 5}), "1")
        assert hung.fault == "timeout" and 0.9 <= time.monotonic() - t0 < 2.5
        assert runner.calls == 51


class RaisingUnreadably(Exception):
    def __str__(self):
        raise ValueError("no message for you")


class BadGuessEnv(GuessEnv):
    def step(self, action):
        raise RaisingUnreadably()

    async def close(self):
        import asyncio

        await asyncio.sleep(0.2)
        BadGuessEnv.closed += 1

    closed = 0


def test_an_exception_without_a_message_is_still_a_fault_and_closes_finish_at_shutdown():
    """An exception whose ``str`` raises comes back as a ``raised`` fault (before, a claimed call could be left
    unset and its episode wait forever); the coroutine ``close`` of 5 episodes started just before shutdown runs to
    its end inside shutdown's grace; a call that hangs past the grace is settled by shutdown, not left waiting."""
    runner = EnvRunner(max_concurrency=8, step_timeout_s=30)
    out = runner.start(BadGuessEnv({}, {"target": 5}), "step", "1").result(timeout=5)
    assert out.fault == "raised" and "RaisingUnreadably" in out.detail
    closes = [runner.start(BadGuessEnv({}, {"target": 5}), "close") for _ in range(5)]
    hung = runner.start(SleepyGuessEnv({"latency_s": 3.0}, {"target": 5}), "step", "1")
    t0 = time.monotonic()
    runner.shutdown(grace_s=0.8)
    assert time.monotonic() - t0 < 2.5
    assert BadGuessEnv.closed == 5 and all(f.result(timeout=0).fault is None for f in closes)
    assert hung.result(timeout=0).fault == "raised" and "shut down" in hung.result().detail
    late = runner.start(GuessEnv({}, {"target": 6}), "step", "3").result(timeout=0)  # after shutdown: a fault
    assert late.fault == "raised" and "shut down" in late.detail


def test_a_deadline_that_fires_before_the_call_is_submitted_is_still_a_timeout():
    """A loaded box can delay the pool's submit past a tiny deadline: the outcome is a ``timeout`` (not a garbled
    ``raised``), the call submitted after it is abandoned (cancelled while queued, or counted stuck while it runs),
    and nothing raises."""
    ran = []

    class Recording(SleepyGuessEnv):
        def step(self, action):
            ran.append(action)
            return super().step(action)

    with EnvRunner(max_concurrency=2, step_timeout_s=0.05) as runner:
        submit = runner._pool.submit

        def slow_submit(*args):
            time.sleep(0.15)
            return submit(*args)

        runner._pool.submit = slow_submit
        out = runner.start(Recording({"latency_s": 0.5}, {"target": 5}), "step", "1").result(timeout=5)
        assert out.fault == "timeout" and "step_timeout_s" in out.detail
        time.sleep(0.05)
        assert runner.stuck == (1 if ran else 0)  # inside the call past its deadline, or never started
        deadline = time.monotonic() + 5
        while runner.stuck and time.monotonic() < deadline:
            time.sleep(0.02)
        assert runner.stuck == 0 and dict(runner.faults)["timeout"] == 1 and runner.calls == 1


def test_no_deadline_keeps_nothing_queued_for_one():
    with EnvRunner(max_concurrency=2, step_timeout_s=float("inf")) as runner:
        for _ in range(20):
            assert runner.step(GuessEnv({}, {"target": 6}), "3").fault is None
        assert runner._deadlines._heap == [] and runner._deadlines._thread is None
