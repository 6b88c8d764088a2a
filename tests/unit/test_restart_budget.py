"""The rollout-worker restart budget (launch/restart_budget.py): ``cluster.max_worker_restarts`` within a sliding
``cluster.worker_restart_window_s``, so sporadic deaths hours apart never end a long run while a crash loop does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncppo.launch.restart_budget import RestartBudget


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_window_forgets_old_restarts_and_a_burst_spends_it():
    clock = Clock()
    budget = RestartBudget(3, 100.0, clock)
    for t in (0.0, 10.0, 20.0):  # a crash loop: three deaths within seconds
        clock.t = t
        assert budget.take()
    clock.t = 30.0
    assert not budget.take() and budget.recent() == 3  # the fourth ends the run
    clock.t = 99.5
    assert not budget.take()  # the window is (now - 100, now]: the death at t=0 still counts at t=99.5
    clock.t = 100.0
    assert budget.recent() == 2 and budget.take()  # ... and has left it at t=100
    assert budget.recent() == 3 and budget.span() == " within 100s"  # those at t = 10, 20 and 100


def test_sporadic_deaths_never_add_up_under_a_window_but_do_over_the_whole_run():
    windowed, whole = RestartBudget(3, 3600.0, Clock()), RestartBudget(3, None, Clock())
    for hour in range(10):  # one death every two hours for twenty hours
        windowed.clock.t = whole.clock.t = hour * 7200.0
        assert windowed.take()
        assert whole.take() == (hour < 3)
    assert windowed.recent() == 1  # all ten were taken (above); one counts now
    assert whole.recent() == 3 and whole.span() == ""


def test_no_restarts_allowed_means_none_ever():
    budget = RestartBudget(0, 3600.0, Clock())
    assert not budget.take() and budget.recent() == 0


def test_a_spent_window_ends_the_run_naming_both_options():
    from asyncppo.launch.supervise import Supervisor, WorkerFailed

    plan = SimpleNamespace(num_workers=2, embodied=False, replace_dead_workers=True, max_worker_restarts=2,
                           worker_restart_window_s=3600.0, timeout_s=600.0)
    run = SimpleNamespace(plan=plan, cfg_dict={"cluster": {"hang_timeout_s": None}}, workers={}, learner=None,
                          worker_hosts={})
    supervisor = Supervisor(run, console=None, started_at=0.0)
    clock = supervisor.budget.clock = Clock()
    assert supervisor.budget.take() and supervisor.budget.take()  # two replacements, at t = 0
    clock.t = 60.0
    with pytest.raises(WorkerFailed) as err:
        supervisor._replace(0, RuntimeError("The actor died unexpectedly"))
    assert str(err.value).startswith(
        "rollout worker 0 died after 2 restart(s) within 3600s, the limit (cluster.max_worker_restarts=2 per "
        "cluster.worker_restart_window_s=3600): an actor failed:\n"), str(err.value)
    assert supervisor.incarnations == {0: 0, 1: 0}  # nothing was started


@pytest.mark.parametrize("value,ok", [(None, True), (60.0, True), (0.0, False), (-5.0, False)])
def test_the_window_option_is_checked_by_name(value, ok):
    from asyncppo.config import load_config

    override = f"cluster.worker_restart_window_s={'null' if value is None else value}"
    if ok:
        assert load_config([override]).cluster.worker_restart_window_s == value
    else:
        with pytest.raises(Exception, match="cluster.worker_restart_window_s"):
            load_config([override])
