"""The hang detector's decision (launch/hang.py: judge / hang_verdict) and the auto deadlines (config/deadlines.py),
as pure functions of what was seen and when, on hand-computed cases: each rule, and the cases that must not be hung
(all peers late together, a worker answering late but answering, a worker in start-up, a worker waiting)."""

from __future__ import annotations

import pytest

from asyncppo.config.deadlines import HANG_FLOOR_S, hang_timeout, push_timeout, silent_timeout
from asyncppo.launch.hang import Seen, hang_verdict, judge, steady_gap

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
    run = SimpleNamespace(plan=plan, cfg_dict={"cluster": {"hang_timeout_s": None}}, workers={}, learner=None,
                          worker_hosts={})
    supervisor = Supervisor(run, console=None, started_at=0.0)
    with pytest.raises(WorkerFailed) as err:
        supervisor._replace(1, "no answer to a control ping for 61s (hang timeout 60s)", hung=True)
    assert str(err.value) == ("rollout worker 1 hung (no answer to a control ping for 61s (hang timeout 60s)) after "
                              "0 restart(s), the limit (cluster.max_worker_restarts=0)")
    assert supervisor.budget.recent() == 0 and supervisor.incarnations == {0: 0, 1: 0}
    # a worker on another machine than the learner's is named with that machine (launch/start.py worker_hosts)
    run.worker_hosts = {1: "10.231.0.2"}
    with pytest.raises(WorkerFailed) as err:
        supervisor._replace(1, "no answer to a control ping for 16s", hung=True)
    assert str(err.value).startswith("rollout worker 1 on host 10.231.0.2 hung (no answer"), str(err.value)


# ---------------------------------------------------------------------------------------------- the silent rule (3)
SILENT = 15.0


def _steady_ref(until: float, every: float = 2.0, start: float = 0.0, phase: str = "waiting") -> Seen:
    """A peer (or the learner) answering every ``every`` seconds from ``start`` to ``until``."""
    ref = Seen(started_at=start)
    t = start
    while t <= until:
        ref.answer(t, phase, int(t), steady_gap(SILENT))
        t += every
    return ref


def _stopped_at(t_stop: float) -> Seen:
    """A worker answering every 2 s, generating, until it is stopped at ``t_stop``."""
    seen = Seen(started_at=0.0)
    for t in range(0, int(t_stop) + 1, 2):
        seen.answer(float(t), "generating", t, steady_gap(SILENT))
    return seen


def test_steady_gap_and_silent_timeout():
    assert steady_gap(15.0) == 7.5 and steady_gap(4.0) == 6.0  # at least three ping periods
    assert silent_timeout(15.0, 60.0) == 15.0 and silent_timeout(15.0, 10.0) == 10.0  # never past the hang timeout
    assert silent_timeout(None, 60.0) is None  # null: no silent rule


def test_a_stopped_worker_is_found_after_the_silent_deadline_while_its_peers_answer():
    """SIGSTOP at t=100 (last answer at t=100): the learner and the other worker answer every 2 s throughout."""
    seen, learner, peer = _stopped_at(100), _steady_ref(200), _steady_ref(200)
    assert judge(seen, 114.9, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[peer]) is None
    verdict = judge(seen, 115.5, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[peer])
    assert verdict is not None and verdict.rule == "silent"
    assert verdict.why == ("no answer to a control ping for 16s while the learner and 1 other worker(s) answered "
                           "every 8s or sooner (silent deadline 15s, cluster.silent_timeout_s)")
    # one worker alone: the learner is the reference
    assert judge(seen, 115.5, HANG, GRACE, silent_s=SILENT, learner=learner).rule == "silent"
    # hang_verdict says the same in words
    assert "cluster.silent_timeout_s" in hang_verdict(seen, 115.5, HANG, GRACE, silent_s=SILENT, learner=learner,
                                                      peers=[peer])


def test_everybody_late_together_blames_nobody():
    """A machine-wide stall from t=100 to t=130 (swapping, a stalled Ray, the launcher descheduled): nothing
    answers, then every answer comes in at once, the stalled worker's a moment after the others'. The silent rule
    stays quiet throughout; only the hang timeout could still find a worker that never answers again."""
    learner, peer, seen = _steady_ref(100), _steady_ref(100), _stopped_at(100)
    for now in (110.0, 116.0, 125.0, 129.0):  # nobody answered: the learner is not steady
        assert judge(seen, now, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[peer]) is None
    learner.answer(130.0, "learner", 0, steady_gap(SILENT))  # the stall ends: the peers answer first...
    peer.answer(130.0, "waiting", 130, steady_gap(SILENT))
    assert judge(seen, 130.0, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[peer]) is None
    seen.answer(131.0, "generating", 131, steady_gap(SILENT))  # ...and the worker a second later: alive, no verdict
    for t in range(132, 200, 2):
        learner.answer(float(t), "learner", 0, steady_gap(SILENT))
        peer.answer(float(t), "waiting", t, steady_gap(SILENT))
        seen.answer(float(t), "generating", t, steady_gap(SILENT))
        assert judge(seen, float(t), HANG, GRACE, silent_s=SILENT, learner=learner, peers=[peer]) is None
    # a worker stopped during the stall is found once the peers have answered steadily for the silent deadline
    stopped, learner2, peer2 = _stopped_at(100), _steady_ref(100), _steady_ref(100)
    for t in range(130, 160, 2):
        learner2.answer(float(t), "learner", 0, steady_gap(SILENT))
        peer2.answer(float(t), "waiting", t, steady_gap(SILENT))
    assert judge(stopped, 144.0, HANG, GRACE, silent_s=SILENT, learner=learner2, peers=[peer2]) is None
    assert judge(stopped, 146.0, HANG, GRACE, silent_s=SILENT, learner=learner2, peers=[peer2]).rule == "silent"


def test_a_late_learner_or_a_late_peer_vetoes_the_silent_rule():
    seen = _stopped_at(100)
    late_learner = _steady_ref(200, every=9.0)  # answers, but 9 s apart: the machine is slow
    assert judge(seen, 120.0, HANG, GRACE, silent_s=SILENT, learner=late_learner, peers=[_steady_ref(200)]) is None
    late_peer = _steady_ref(200, every=9.0)
    assert judge(seen, 120.0, HANG, GRACE, silent_s=SILENT, learner=_steady_ref(200), peers=[late_peer]) is None
    # two workers stopped together: each sees the other silent, so neither is blamed by this rule; the hang
    # timeout finds both
    other = _stopped_at(100)
    assert judge(seen, 120.0, HANG, GRACE, silent_s=SILENT, learner=_steady_ref(200), peers=[other]) is None
    assert judge(seen, 161.0, HANG, GRACE, silent_s=SILENT, learner=_steady_ref(200), peers=[other]).rule == "silence"
    # nothing seen of the learner yet, or the rule switched off: no silent verdict
    assert judge(seen, 120.0, HANG, GRACE, silent_s=SILENT, learner=None) is None
    assert judge(seen, 120.0, HANG, GRACE, silent_s=None, learner=_steady_ref(200)) is None


def test_a_worker_answering_late_but_answering_is_not_silent():
    """A busy worker whose pings take 12 s each (its interpreter held by long calls): its answers come 12 s apart,
    never 15 s, while everybody else answers every 2 s."""
    learner, peer = _steady_ref(400), _steady_ref(400)
    seen = Seen(started_at=0.0)
    for t in range(10, 400, 12):
        seen.answer(float(t), "generating", t, steady_gap(SILENT))
        for now in (t + 0.5, t + 6.0, t + 11.9):
            assert judge(seen, now, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[peer]) is None
    assert seen.longest_gap == 12.0


def test_a_worker_in_start_up_is_not_judged_by_the_silent_rule():
    learner, peer = _steady_ref(400), _steady_ref(400)
    constructing = Seen(started_at=100.0)  # Ray answers nothing while it constructs the actor
    assert judge(constructing, 300.0, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[peer]) is None
    starting = Seen(started_at=100.0)
    starting.answer(110.0, "starting", 0, steady_gap(SILENT))  # then imports and the engine build hold it
    assert judge(starting, 300.0, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[peer]) is None
    # and a peer in start-up (a replacement building its engine, late to answer) neither vetoes nor counts
    seen = _stopped_at(100)
    assert judge(seen, 116.0, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[constructing, starting]).rule \
        == "silent"


def test_a_replacement_peer_that_just_started_answering_vetoes_until_it_is_steady():
    learner, seen = _steady_ref(400), _stopped_at(100)
    fresh = Seen(started_at=90.0)
    for t in range(108, 130, 2):  # past its start-up from t=108: steady since then, not over the last 15 s yet
        fresh.answer(float(t), "waiting", t, steady_gap(SILENT))
    assert judge(seen, 117.0, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[fresh]) is None
    assert judge(seen, 124.0, HANG, GRACE, silent_s=SILENT, learner=learner, peers=[fresh]).rule == "silent"


# ------------------------------------------------------------------------------------ text environments (rule 6)
def test_a_pool_whose_calls_all_hang_is_hung_after_the_hang_timeout():
    seen = _seen(answers=[(t, "generating", t) for t in range(0, 200, 2)])  # idle waits count as steps
    seen.answer(200.0, "generating", 200, env={"stuck": 3, "unanswered_s": 59.0, "returned": 12})
    assert judge(seen, 201.0, HANG, GRACE) is None
    seen.answer(202.0, "generating", 202, env={"stuck": 3, "unanswered_s": 61.0, "returned": 12})
    verdict = judge(seen, 203.0, HANG, GRACE)
    assert verdict.rule == "environment" and "3 call(s) still running past env.step_timeout_s" in verdict.why
    # a slow environment that answers late (nothing stuck), or one that hangs some calls and answers others
    seen.answer(204.0, "generating", 204, env={"stuck": 0, "unanswered_s": 300.0, "returned": 12})
    assert judge(seen, 205.0, HANG, GRACE) is None
    seen.answer(206.0, "generating", 206, env={"stuck": 5, "unanswered_s": 1.0, "returned": 40})
    assert judge(seen, 207.0, HANG, GRACE) is None


def test_every_verdict_is_a_line_of_hangs_jsonl_and_the_watch_is_summed_up_at_the_end(tmp_path):
    """The launcher's record of its verdicts (launch/supervise.py): one line per worker found hung and replaced, with
    the rule; a worker whose run already ended is neither replaced nor counted; hang_watch.json at the end."""
    import json
    from types import SimpleNamespace

    from asyncppo.launch.hang import Verdict
    from asyncppo.launch.supervise import Supervisor

    plan = SimpleNamespace(num_workers=2, embodied=False, replace_dead_workers=True, max_worker_restarts=3,
                           worker_restart_window_s=3600.0, timeout_s=600.0, output_dir=str(tmp_path))
    run = SimpleNamespace(plan=plan, cfg_dict={"cluster": {"hang_timeout_s": None}}, workers={}, learner=None,
                          worker_refs={"ref-1": 1}, worker_hosts={})
    supervisor = Supervisor(run, console=None, started_at=0.0)
    why = "no answer to a control ping for 16s while the learner and 1 other worker(s) answered every 8s or sooner"
    supervisor.hangs.poll = lambda: [(1, Verdict("silent", why)), (0, Verdict("progress", "no progress"))]
    supervisor._replace = lambda i, why, hung=False: f"ref-{i}.1"
    assert supervisor._replace_hung(["ref-1", "learner"]) == ["learner", "ref-1.1"]
    (line,) = [json.loads(x) for x in (tmp_path / "hangs.jsonl").read_text().splitlines()]
    assert (line["worker"], line["incarnation"], line["rule"], line["why"]) == (1, 0, "silent", why)
    supervisor._write_hang_watch()
    watch = json.loads((tmp_path / "hang_watch.json").read_text())
    assert watch["verdicts"] == 1 and watch["silent_timeout_s"] == 15.0 and watch["hang_timeout_s"] == 60.0
