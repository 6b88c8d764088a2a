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


def test_a_coroutine_environment_reuses_its_threads_loop_and_leaves_nothing_running():
    with EnvRunner(max_concurrency=1, step_timeout_s=30) as runner:
        for _ in range(3):
            assert runner.step(LeakyGuessEnv({}, {"target": 6}), "3").fault is None
    assert len(LeakyGuessEnv.leaked) == 3 and all(t.cancelled() for t in LeakyGuessEnv.leaked)
    loops = {t.get_loop() for t in LeakyGuessEnv.leaked}
    assert len(loops) == 1 and not next(iter(loops)).is_closed()  # one pool thread, one loop, kept for its life
