"""An environment whose ``step`` raises (envs/worker.py: ``EnvWorker._recover``): the env worker makes a fresh
vector env, collects the segment again and counts the error; only an environment that raises several times in a row
ends the worker. Real gymnasium, the real worker and segment builder (tests/gym_envs.py's FaultyCartPole); no learner
is needed because no segment is finished here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from asyncppo.config import load_config
from asyncppo.envs.segments import SegmentBuilder
from asyncppo.envs.spaces import EnvError, describe_env
from asyncppo.envs.worker import MAX_ERRORS_IN_ROW, EnvWorker

FAULTY = "tests.gym_envs:FaultyCartPole-v1"


def _worker(*overrides: str) -> EnvWorker:
    cfg = load_config(["env=cartpole", f"env.id={FAULTY}", "env.segment_length=64", *overrides])
    worker = EnvWorker(cfg, worker_id=0, num_workers=1, endpoints=None)
    worker._open_workload()
    worker._ticket = SimpleNamespace(index=0, min_version=0)  # the segment's ticket (never sent here)
    worker.version = 0
    return worker


def test_a_step_that_raises_gets_a_fresh_env_and_the_segment_collected_again(capsys):
    worker = _worker("+env.kwargs.raise_every=5")  # every env raises on its 5th step after each (re)start
    first_env = worker.env
    for _ in range(30):
        worker._step()
    # 6 rounds of 4 good steps and a raise: each raise discards the 4 steps and starts from a fresh reset
    assert worker.stats["env_errors"] == 6 and worker.builder.t == 0
    assert worker.stats["env_steps"] == 24 * 8 and worker.progress == 24
    assert worker.env is not first_env and first_env.closed and worker.env in worker._closables
    assert first_env not in worker._closables
    assert worker.builder._timings["env_errors"] == 6.0  # reported with the next segment that is sent
    told = [line for line in capsys.readouterr().out.splitlines() if "the environment raised" in line]
    assert len(told) == 1 and "scripted error at step 5" in told[0]  # told once, with the error


def test_an_environment_that_always_raises_ends_the_worker_naming_it():
    worker = _worker("+env.kwargs.raise_every=1")
    for _ in range(MAX_ERRORS_IN_ROW - 1):
        worker._step()
    with pytest.raises(EnvError, match=rf"env.id='{FAULTY}' raised {MAX_ERRORS_IN_ROW} times in a row .*scripted"):
        worker._step()


def test_a_good_step_between_two_errors_starts_the_count_again():
    worker = _worker("+env.kwargs.raise_every=2")  # raise, good, raise, good, ...: never two in a row
    for _ in range(4 * MAX_ERRORS_IN_ROW):
        worker._step()
    assert worker.stats["env_errors"] == 2 * MAX_ERRORS_IN_ROW


def test_the_restarted_segment_drops_unfinished_episodes_and_carries_the_error_count():
    cfg = load_config(["env=cartpole", "env.segment_length=4"])
    desc = describe_env(cfg.env)
    builder = SegmentBuilder(desc, num_envs=2, length=4)
    obs = np.zeros((2, 4), np.float32)
    builder.start(obs)
    step = lambda: builder.record(np.zeros(2, np.int64), np.zeros(2, np.float32), np.ones(2), np.zeros(2, bool),
                                  np.zeros(2, bool), obs, {}, version=3)
    step()
    step()
    builder.restart(obs)  # the env raised: the two steps above and the episodes' partial returns are gone
    assert builder.t == 0 and builder.ep_return.tolist() == [0.0, 0.0] and builder.ep_length.tolist() == [0, 0]
    for _ in range(4):
        step()
    seg = builder.finish(ticket=7, segment_id="0-0")
    assert seg.timings["env_errors"] == 1.0 and seg.rewards.shape == (2, 4) and seg.versions.tolist() == [3] * 4
    builder.start(obs)
    for _ in range(4):
        step()
    assert builder.finish(ticket=8, segment_id="0-1").timings["env_errors"] == 0.0  # counted once
