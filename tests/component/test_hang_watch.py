"""The launcher's hang watch (launch/hang.py: HangWatch) against real Ray actors in real processes: one stopped with
SIGSTOP, one busy in pure Python, one whose pings take 3 s to answer, and a learner that answers its health reads.

What it shows: ``ray.wait`` never sees the stopped actor's ping ready (its process runs nothing), while a busy actor
answers within milliseconds (another thread of the actor answers); the stopped one is found by the silent rule a
little after the silent deadline, and neither the busy nor the slow one is ever judged hung. And a worker whose
text-environment calls all hang (a real EnvRunner in the actor's process) keeps answering with a moving counter, and is
found by the environment rule from what its ping reports."""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from asyncppo.launch.hang import HangWatch  # noqa: E402

pytestmark = pytest.mark.slow  # Ray's start-up: ~10 s on the 2-core box
SILENT_S = 4.0


@ray.remote(max_concurrency=3)
class Worker:
    """A rollout worker's shape: run() on one thread, the ping answered by another."""

    def __init__(self, answer_after_s: float = 0.0):
        self.answer_after_s, self.progress, self.phase = answer_after_s, 0, "starting"

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> None:
        self.phase = "generating"
        while True:  # busy in Python: the interpreter lock is handed over every 5 ms
            sum(range(20000))
            self.progress += 1

    def heartbeat(self) -> dict:
        time.sleep(self.answer_after_s)
        return {"phase": self.phase, "progress": self.progress, "incarnation": 0}


@ray.remote(max_concurrency=2)
class EpisodeWorker:
    """An episode worker's shape: its loop steps (the counter moves, idle waits count) while every call it hands its
    text environments hangs; the ping reports the runner's health, as EpisodeRolloutWorker's does."""

    def __init__(self):
        from asyncppo.envs.env_runner import EnvRunner
        from asyncppo.envs.examples import GuessEnv

        class Hanging(GuessEnv):
            def step(self, action):
                time.sleep(3600)

        self.env, self.runner, self.progress = Hanging({}, {"target": 3}), EnvRunner(4, step_timeout_s=0.5), 0

    def run(self) -> None:
        while True:
            self.runner.start(self.env, "step", "1").result()  # comes back at its deadline, as a timeout
            self.progress += 1

    def heartbeat(self) -> dict:
        return {"phase": "generating", "progress": self.progress, "incarnation": 0, "env": self.runner.health()}


@ray.remote
class Learner:
    def health(self) -> dict:
        return {"step_seconds": [], "push_late": []}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_stopped_worker_is_found_by_the_silent_rule_and_the_busy_and_slow_ones_are_not(ray_cluster):
    stopped, busy, slow = Worker.remote(), Worker.remote(), Worker.remote(answer_after_s=3.0)
    workers = {0: stopped, 1: busy, 2: slow}
    pid = ray.get(stopped.pid.remote())
    runs = [w.run.remote() for w in workers.values()]
    watch = HangWatch(lambda: workers, {0: 0, 1: 0, 2: 0}, Learner.remote(), hang_timeout_s=60, timeout_s=600,
                      silent_timeout_s=SILENT_S)
    verdicts: list = []

    def poll_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            verdicts.extend((time.monotonic(), i, v) for i, v in watch.poll())
            time.sleep(0.2)

    try:
        poll_for(12.0)  # every worker past its start-up, answering
        assert verdicts == []
        assert all(watch.seen[i].phase == "generating" for i in workers)
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        poll_for(SILENT_S + 6.0)
        assert verdicts, "the stopped worker was not found"
        found_at, worker, verdict = verdicts[0]
        print(f"found {found_at - t_stop:.1f}s after SIGSTOP: {verdict.why}; longest gaps {watch.longest_gaps()}")
        assert worker == 0 and verdict.rule == "silent", verdicts[0]
        assert SILENT_S - 2.5 < found_at - t_stop <= SILENT_S + 2.5  # silence counts from its last answer
        assert {i for _, i, _ in verdicts} == {0}, "a busy or slow worker was judged hung"
        assert watch.longest_gaps()[1] < 3.0 and 3.0 <= watch.longest_gaps()[2] < SILENT_S
    finally:
        for w in workers.values():
            ray.kill(w)
        os.kill(pid, signal.SIGCONT)
        del runs


def test_a_worker_whose_environment_calls_all_hang_is_found_by_the_environment_rule(ray_cluster):
    worker, peer = EpisodeWorker.remote(), Worker.remote()
    workers = {0: worker, 1: peer}
    runs = [w.run.remote() for w in workers.values()]
    watch = HangWatch(lambda: workers, {0: 0, 1: 0}, Learner.remote(), hang_timeout_s=3.0, timeout_s=600,
                      silent_timeout_s=SILENT_S)
    t0, found = time.monotonic(), []
    try:
        while not found and time.monotonic() < t0 + 30:
            found = watch.poll()
            time.sleep(0.2)
        assert [(i, v.rule) for i, v in found] == [(0, "environment")], found
        assert "still running past env.step_timeout_s" in found[0][1].why
        assert watch.seen[0].progress > 2  # its loop went on stepping: only the environment rule could see it
    finally:
        for w in workers.values():
            ray.kill(w)
        del runs
