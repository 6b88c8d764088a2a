"""The guess game behind a slow tool (``ToolLatencyGuessEnv``): each answer takes the configured latency, spent
awaiting, so concurrent episodes wait side by side rather than in turn; the latency-hiding benchmark rests on it."""

from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np
import pytest

from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.examples import GuessEnv, ToolLatencyGuessEnv
from asyncppo.metrics.rollout import episode_metrics
from asyncppo.stream.records import Sample, TrajectoryGroup


def test_each_step_takes_the_stated_latency_and_answers_as_the_guess_game():
    with EnvRunner(max_concurrency=8, step_timeout_s=30) as runner:
        for latency in (0.0, 0.2):
            slow, plain = ToolLatencyGuessEnv({"latency_s": latency}, {"target": 6}), GuessEnv({}, {"target": 6})
            out = runner.step(slow, "3")
            assert out.fault is None and out.observations == plain.step("3")[0] == [{"role": "user",
                                                                                   "content": "higher"}]
            assert latency <= out.seconds < latency + 0.5, (latency, out.seconds)
        solved = runner.step(ToolLatencyGuessEnv({"latency_s": 0.2}, {"target": 6}), "6")
        assert (solved.reward, solved.done) == (1.0, True) and solved.seconds >= 0.2


def test_concurrent_steps_wait_side_by_side():
    """8 steps of 0.3 s each through a pool of 8: about 0.3 s in all, not the 2.4 s of waiting in turn."""
    envs = [ToolLatencyGuessEnv({"latency_s": 0.3}, {"target": 5}) for _ in range(8)]
    # the callers wait in threads of their own, as the episode engine's waiters do
    with EnvRunner(max_concurrency=8, step_timeout_s=30) as runner, cf.ThreadPoolExecutor(8) as callers:
        t0 = time.perf_counter()
        futures = [callers.submit(runner.step, env, "1") for env in envs]
        outcomes = [f.result(timeout=30) for f in futures]
        took = time.perf_counter() - t0
    assert all(o.fault is None and o.seconds >= 0.3 for o in outcomes)
    assert took < 1.2, took


def test_a_bad_latency_is_refused_by_name():
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="env.text_env_config.latency_s"):
            ToolLatencyGuessEnv({"latency_s": bad})


def test_env_wait_seconds_are_summed_over_a_steps_groups():
    def group(key, wait):
        sample = Sample(np.zeros(6, np.int32), np.zeros(6, np.float32), 0.0, "stop", 0, 0,
                        env_runs=np.array([[2, 2]], np.int64), turn_rewards=np.zeros(2))
        return TrajectoryGroup(key, 0, np.zeros(2, np.int32), [sample], timings={"env_calls": 1.0, "env_wait_s": wait})

    assert episode_metrics([group("a", 0.25), group("b", 0.5)])["episodes/env_wait_s"] == 0.75
