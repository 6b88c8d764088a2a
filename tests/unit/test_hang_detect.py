"""The hang detector's decision (launch/hang.py: hang_verdict) and the auto deadlines (config/deadlines.py), as pure
functions of what was seen and when, on hand-computed cases."""

from __future__ import annotations

import pytest

from asyncppo.config.deadlines import HANG_FLOOR_S, hang_timeout, push_timeout
from asyncppo.launch.hang import Seen, hang_verdict

HANG, GRACE = 60.0, 600.0


def _seen(started: float = 0.0, answers: tuple = ()) -> Seen:
    """A worker started at ``started`` whose pings were answered with ``answers`` = ((time, phase, progress), ...)."""
    seen = Seen(started_at=started)
    for t, phase, progress in answers:
        seen.answer(t, phase, progress)
    return seen


def test_auto_hang_timeout_is_ten_median_steps_with_a_floor_and_a_cap():
    assert hang_timeout(None, [], 600) == HANG_FLOOR_S == 60  # nothing measured yet: the floor
    assert hang_timeout(None, [0.9, 1.0, 30.0], 600) == 60  # median 1.0 s -> 10 s, below the floor
    assert hang_timeout(None, [8.0, 9.0, 10.0, 500.0], 600) == 95  # median 9.5 s -> 95 s (one slow step ignored)
    assert hang_timeout(None, [100.0], 600) == 600  # 1000 s capped at cluster.timeout_s
    assert hang_timeout(None, [], 30) == 30  # the floor never outlasts cluster.timeout_s either
    assert hang_timeout(25.0, [100.0], 600) == 25  # configured: taken as is
    assert hang_timeout(900.0, [], 600) == 600


def test_push_timeout_defaults_to_the_hang_timeout():
    assert push_timeout(None, None, [9.0, 10.0], 600) == 95
    assert push_timeout(None, 42.0, [], 600) == 42
    assert push_timeout(7.0, 42.0, [], 600) == 7


def test_a_generating_worker_that_keeps_stepping_is_not_hung():
    # answers every 2 s, progress grows each time: 200 s in, fine
    seen = _seen(answers=[(t, "generating", t) for t in range(10, 201, 2)])
    assert hang_verdict(seen, 201.0, HANG, GRACE) is None


def test_a_generating_worker_whose_counter_stops_is_hung_after_the_timeout():
    # answers (so the process is alive) but progress stays at 5 from t=20: a wedged engine or reward function
    seen = _seen(answers=[(10.0, "generating", 4), (20.0, "generating", 5)]
                 + [(t, "generating", 5) for t in range(22, 90, 2)])
    assert hang_verdict(seen, 80.0, HANG, GRACE) is None  # 60 s without a step: not yet over
    why = hang_verdict(seen, 81.0, HANG, GRACE)
    assert why is not None and "no progress (decode or env step, group sent) for 61s while generating" in why


def test_a_stopped_worker_answers_nothing_and_is_hung_after_the_timeout():
    seen = _seen(answers=[(10.0, "generating", 1), (12.0, "generating", 2)])  # then SIGSTOP: no more answers
    assert hang_verdict(seen, 72.0, HANG, GRACE) is None  # 60 s of silence
    why = hang_verdict(seen, 72.5, HANG, GRACE)
    assert why is not None and "no answer to a control ping for 60s" in why
    # silence counts in every phase, waiting included: a stopped process cannot say it is waiting
    waiting = _seen(answers=[(10.0, "waiting", 3)])
    assert "no answer" in hang_verdict(waiting, 71.0, HANG, GRACE)


def test_waiting_on_admission_is_not_hung():
    # the staleness bound holds admission for 500 s (the learner is slow, or waits for another worker's tickets):
    # the worker answers every ping, its counter does not move, and it is waiting, not hung
    seen = _seen(answers=[(10.0, "generating", 7)] + [(t, "waiting", 8) for t in range(12, 513, 2)])
    assert hang_verdict(seen, 513.0, HANG, GRACE) is None
    # so is one that cannot hand a finished group over (the learner does not take it)
    sending = _seen(answers=[(t, "sending", 9) for t in range(0, 513, 2)])
    assert hang_verdict(sending, 513.0, HANG, GRACE) is None


def test_engine_start_up_grace():
    # the actor is being constructed (imports, engine build): no answer at all for 300 s is fine with a 600 s grace
    assert hang_verdict(_seen(started=0.0), 300.0, HANG, GRACE) is None
    why = hang_verdict(_seen(started=0.0), 601.0, HANG, GRACE)
    assert why is not None and "since it started" in why and "start-up grace 600s" in why
    # answering as "starting" with nothing moving: also up to the grace, silence included
    starting = _seen(answers=[(5.0, "starting", 0)])
    assert hang_verdict(starting, 400.0, HANG, GRACE) is None
    answering = _seen(answers=[(5.0, "starting", 0)] + [(t, "starting", 0) for t in range(7, 606, 2)])
    assert hang_verdict(answering, 604.0, HANG, GRACE) is None  # 599 s since it last moved
    assert "still starting after 601s" in hang_verdict(answering, 606.0, HANG, GRACE)


def test_loading_weights_gets_the_grace_for_progress_but_not_for_silence():
    loading = _seen(answers=[(t, "loading", 3) for t in range(0, 301, 2)])
    assert hang_verdict(loading, 301.0, HANG, GRACE) is None  # a slow load of a large model
    stopped_mid_load = _seen(answers=[(10.0, "loading", 3)])
    assert "no answer to a control ping for 61s" in hang_verdict(stopped_mid_load, 71.0, HANG, GRACE)


def test_a_missed_push_deadline_is_hung_at_once():
    seen = _seen(answers=[(10.0, "generating", 1), (11.0, "generating", 2)])
    why = "rollout worker 1 (incarnation 0) did not take the weights pushed to it within 60s"
    assert hang_verdict(seen, 12.0, HANG, GRACE, push_late=why) == why


def test_moving_to_a_new_phase_counts_as_progress():
    # waiting for 100 s, then a ticket comes and it starts generating at t=110: the generation clock starts there
    seen = _seen(answers=[(t, "waiting", 4) for t in range(10, 111, 2)] + [(112.0, "generating", 4)])
    assert hang_verdict(seen, 160.0, HANG, GRACE) is None
    seen.answer(171.0, "generating", 4)
    assert "for 61s while generating" in hang_verdict(seen, 173.0, HANG, GRACE)


@pytest.mark.parametrize("value", [0.0, -1.0, 601.0])
def test_bad_hang_and_push_timeouts_are_refused_by_name(value):
    from asyncppo.config import load_config

    for name in ("hang_timeout_s", "push_timeout_s"):
        with pytest.raises(Exception, match=f"cluster.{name}"):
            load_config([f"cluster.{name}={value}"])


def test_a_hang_with_no_replacement_left_ends_the_run_naming_the_worker():
    """cluster.max_worker_restarts=0 (or the restarts used up): the hung worker ends the run with an error that says
    which worker, why, for how long, and which option to raise; nothing is started."""
    from types import SimpleNamespace

    from asyncppo.launch.supervise import Supervisor, WorkerFailed

    plan = SimpleNamespace(num_workers=2, embodied=False, replace_dead_workers=False, max_worker_restarts=0,
                           worker_restart_window_s=3600.0, timeout_s=600.0)
    run = SimpleNamespace(plan=plan, cfg_dict={"cluster": {"hang_timeout_s": None}}, workers={}, learner=None)
    supervisor = Supervisor(run, console=None, started_at=0.0)
    with pytest.raises(WorkerFailed) as err:
        supervisor._replace(1, "no answer to a control ping for 61s (hang timeout 60s)", hung=True)
    assert str(err.value) == ("rollout worker 1 hung (no answer to a control ping for 61s (hang timeout 60s)) after "
                              "0 restart(s), the limit (cluster.max_worker_restarts=0)")
    assert supervisor.budget.recent() == 0 and supervisor.incarnations == {0: 0, 1: 0}
