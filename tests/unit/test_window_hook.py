"""The learner's window hook (asyncppo/learner/window.py) on a real admission controller: every step's record
carries the window, a move reaches the controller and the console with its reason, a fixed window has no hook, and
the summary table gives the range the window took (launch/console.py). Most tests decide on the test's thread
(``background=False``: step for step); the decision process is tested at the end (pipeline/tuner_host.py)."""

from __future__ import annotations

import copy
import os
import random
import time

import pytest

from asyncppo.config.loader import load_config
from asyncppo.launch.console import window_row
from asyncppo.learner.window import buffer_bound, window_hook
from asyncppo.pipeline.tuner import Move, WindowTuner, decide_on
from asyncppo.pipeline.tuner_host import NICE
from asyncppo.staleness.controller import AdmissionController


class _Group:
    def __init__(self, lengths):
        self._lengths = lengths

    def sample_lengths(self):
        return self._lengths


def _step(rng, B=2):
    """A generation-bound step (the learner waits on a slow engine): the tuner should widen."""
    running = rng.uniform(10, 60)
    metrics = {"rollout/decode_step_s": 0.002 + 0.0004 * running, "rollout/running_mean": running,
               "response_length/mean": 30.0, "time/step_s": 0.05, "time/wait_s": 0.0, "actor/mismatch_kl": 0.0}
    groups = [_Group([max(2, min(400, int(rng.lognormvariate(3.0, 1.0)))) for _ in range(4)]) for _ in range(B)]
    return metrics, groups


def test_moves_reach_the_controller_the_console_and_every_record():
    cfg = load_config(["rollout.max_staleness=auto", "rollout.tune_every=3", "rollout.rollout_batch_size=2",
                       "rollout.num_return_sequences_in_group=4", "rollout.max_staleness_cap=4",
                       "rollout.max_num_seqs=64"])
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    said: list[str] = []
    hook = window_hook(cfg, adm, said.append, background=False)
    rng, records = random.Random(0), []
    for _ in range(60):
        metrics, groups = _step(rng)
        hook.after_step(metrics, groups)
        assert (metrics["tune/k"], metrics["tune/j"]) == (adm.k, adm.j)  # the record says what is in force
        records.append(metrics)
    assert said and all(line.startswith("window k ") and ": " in line for line in said), said
    assert len([r for r in records if "tune/reason" in r]) == len(said) == hook.changes
    assert 1 < adm.k <= 4 and adm.j == adm.k  # widened from 1, a null lookahead follows k, the cap holds
    assert hook.summary()["window"]["k_range"] == [1, adm.k]
    assert hook.j_min == 1  # what a coalesced push is checked against: the smallest j ever in force (loop.py)
    what, value = window_row(records)
    assert what.startswith("window k / j") and value.startswith(f"k 1 -> {adm.k} (1..{adm.k})")


def test_a_fixed_window_has_no_hook_and_the_buffer_guard_is_the_cap_only_under_auto():
    fixed = load_config(["rollout.max_staleness=3"])
    assert window_hook(fixed, None, print) is None and buffer_bound(fixed) == 3 and window_row([{"step": 1}]) is None
    auto = load_config(["rollout.max_staleness=auto", "rollout.max_staleness_cap=9"])
    assert buffer_bound(auto) == 9


def test_a_lowered_lookahead_is_what_a_coalesced_push_must_still_serve():
    """Tickets keep the j of their grant, so after a lowering the push check uses the lower j; after a raise the
    older, lower j still holds for tickets granted before it (j_min never rises)."""
    cfg = load_config(["rollout.max_staleness=auto", "rollout.max_staleness_cap=6"])
    adm = AdmissionController(cfg.rollout.rollout_batch_size, cfg.rollout.max_staleness)
    hook = window_hook(cfg, adm, lambda _line: None, background=False)
    for move, j_min in ((Move(3, 3, "up"), 1), (Move(0, 0, "down"), 0), (Move(2, 2, "up"), 0)):
        hook.tuner.observe = lambda *_a, m=move: m  # the decision itself is test_window_tuner.py's
        hook.after_step({}, [])
        assert (adm.k, adm.j, hook.j_min) == (move.k, move.j, j_min)


def test_a_resumed_run_goes_on_at_the_checkpoints_window_and_pinned_knobs_keep_the_launchs():
    """The hook's state is what a checkpoint keeps (llm_workload.py: trainer state 'window'); restored, the window
    moves to it for later grants, says so, and keeps every rule: a pinned lookahead stays, the cap holds, an old
    checkpoint without a window changes nothing."""
    cfg = load_config(["rollout.max_staleness=auto", "rollout.rollout_batch_size=2", "rollout.max_staleness_cap=6"])
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    said: list[str] = []
    hook = window_hook(cfg, adm, said.append, background=False)
    assert hook.state() == {"k": 1, "j": 1}
    hook.restore(None)  # a checkpoint from before this field, or a fixed window's
    assert (adm.k, adm.j) == (1, 1) and not said
    hook.restore({"k": 4, "j": 4})
    assert (adm.k, adm.j) == (4, 4) and hook.state() == {"k": 4, "j": 4}
    assert said == ["window k 1 -> 4, j 1 -> 4: restored from the checkpoint"]
    assert hook.summary()["window"]["k_range"] == [1, 4] and hook.j_min == 1
    hook.restore({"k": 40, "j": 40})  # past the cap: held at it
    assert (adm.k, adm.j) == (6, 6)

    pinned = load_config(["rollout.max_staleness=auto", "rollout.admission_lookahead=1",
                          "rollout.rollout_batch_size=2"])
    adm2 = AdmissionController(2, pinned.rollout.max_staleness, lookahead=1)
    hook2 = window_hook(pinned, adm2, said.append, background=False)
    hook2.restore({"k": 5, "j": 3})
    assert (adm2.k, adm2.j) == (5, 1)  # k was tuned and comes back; the pinned j stays the launch's


def _auto_cfg():
    return load_config(["rollout.max_staleness=auto", "rollout.tune_every=3", "rollout.rollout_batch_size=2",
                        "rollout.num_return_sequences_in_group=4", "rollout.max_staleness_cap=4",
                        "rollout.max_num_seqs=64"])


def test_a_decision_made_from_the_state_equals_the_one_made_in_place():
    """What the decision process does (decide_on over the tuner's JSON state) is the tuner's own decision: the same
    move, smoothed gains and count, at several windows and histories; a reply for a window no longer in force is
    ignored."""
    import json

    cfg = _auto_cfg()
    hook = window_hook(cfg, AdmissionController(2, cfg.rollout.max_staleness, lookahead=None), lambda _l: None,
                       background=False)
    rng, compared, moves = random.Random(1), 0, 0
    for _ in range(45):
        metrics, groups = _step(rng)
        tuner = hook.tuner
        if tuner.record(metrics, [g.sample_lengths() for g in groups]):
            here = copy.deepcopy(tuner)
            reply = decide_on(json.loads(json.dumps(tuner.state())))  # through JSON, as on the pipe
            move = here.decide()
            assert reply["move"] == ([move.k, move.j, move.reason, move.gain] if move else None)
            assert move is None or move.reason.startswith("drift") or move.gain > -tuner.margin / 4
            assert {(k, j): g for k, j, g in reply["gain"]} == here._gain and reply["evals"] == here._evals
            assert reply["pending"] is here.pending
            compared, moves = compared + 1, moves + (move is not None)
            tuner.take(reply)
            here.apply(move)
            assert (tuner.k, tuner.j, tuner._evals, tuner._gain, tuner._last) == \
                (here.k, here.j, here._evals, here._gain, here._last)
    assert compared == 15 and moves >= 1
    stale = decide_on(hook.tuner.state())
    hook.tuner.apply(Move(hook.tuner.k - 1, hook.tuner.k - 1, "test"))
    assert hook.tuner.take(stale) is None  # judged another window: not put in force


def test_the_decision_process_may_decide_sooner_while_the_window_climbs_on_a_large_predicted_gain():
    """The cool-down after a decision (tuner_host.py): a tenth of the wall time, except after a widening on a
    predicted gain of at least 25%, which allows half; a narrowing, a small gain or no move keep the tenth."""
    from asyncppo.pipeline.tuner_host import share_after

    assert share_after({"at": [2, 2], "move": [3, 3, "engine idle", 0.87]}) == 0.5  # cool-down = the decision's cost
    assert share_after({"at": [2, 2], "move": [3, 2, "engine idle", 0.25]}) == 0.5
    assert share_after({"at": [2, 2], "move": [3, 3, "learner waiting", 0.12]}) == 0.1
    assert share_after({"at": [4, 4], "move": [3, 3, "no predicted loss narrower", 0.4]}) == 0.1
    assert share_after({"at": [2, 2], "move": None}) == 0.1
    assert share_after({"at": [2, 2], "move": [3, 3, "engine idle", 0.9]}, share=0.6) == 0.6  # never below the base
    assert share_after({"at": [2, 2], "move": [3, 3, "an older reply without its gain"]}) == 0.1
    # a climb up the rungs that ended (the next rung stopped paying, or the cap): the climb is over
    assert share_after({"at": [1, 1], "move": [12, 12, "engine idle, 3 rungs", 2.7], "settled": True}) == 0.1

    # the host: a reply's cool-down is the tenth's (9 x its cost) until the hook says it put the move in force
    from asyncppo.pipeline.tuner_host import DecisionHost

    host = DecisionHost()
    try:
        widening = {"at": [2, 2], "move": [3, 3, "engine idle", 0.87], "decide_s": 1.0}
        host.replies.put(widening)
        assert host.poll() is widening and host.not_before - host._replied == pytest.approx(9.0)
        host.taken(widening)
        assert host.not_before - host._replied == pytest.approx(1.0)
        narrowing = {"at": [3, 3], "move": [2, 2, "no predicted loss narrower", 0.0], "decide_s": 1.0}
        host.replies.put(narrowing)
        host.poll()
        host.taken(narrowing)
        assert host.not_before - host._replied == pytest.approx(9.0)
    finally:
        host.close()


def test_the_cool_down_counts_a_decisions_cpu_time_not_its_wall_time():
    """A niced or idle-class decision waits for a core most of its wall time, which costs the run nothing: the
    share rations CPU (tuner_host.py, "Why the cool-down counts CPU time"). A reply without its CPU time (an older
    child) is counted by its wall time."""
    from asyncppo.pipeline.tuner_host import DecisionHost

    host = DecisionHost()
    try:
        host.replies.put({"at": [6, 3], "move": None, "pending": True, "decide_s": 3.0, "decide_cpu_s": 0.4})
        host.poll()
        assert host.not_before - host._replied == pytest.approx(0.4 * 9)  # not 3.0 * 9 = 27 s
        host.replies.put({"at": [6, 3], "move": None, "pending": True, "decide_s": 3.0})
        host.poll()
        assert host.not_before - host._replied == pytest.approx(3.0 * 9)
    finally:
        host.close()


def test_decisions_that_keep_staying_back_off_and_a_move_restores_the_tenth():
    """A decision with no move and none pending halves the share of the next cool-down (9 x its cost at the tenth,
    then 19, 39, 79 and no further); a pending one (a move waiting for patience, or rates not yet fitted) and a move
    put in force, by a decision or by the drift budget, restore the tenth. The ``pending`` flag comes from a real
    decision: on learner-bound rates at the synchronous floor nothing is worth a move and nothing waits."""
    from asyncppo.pipeline.tuner_host import DecisionHost

    rng, t = random.Random(3), WindowTuner(k=0, j=0, cap=8, tune_k=True, tune_j=False, tie_j=True, batch_groups=2,
                                           group_size=4, max_num_seqs=64, every=1000, sim_steps=20)
    for _ in range(6):
        t.record({"rollout/decode_step_s": 0.0002, "rollout/running_mean": 20.0, "response_length/mean": 30.0,
                  "time/step_s": 1.0, "time/wait_s": 0.0, "actor/mismatch_kl": 0.0},
                 [[max(2, int(rng.lognormvariate(3.0, 1.0))) for _ in range(4)] for _ in range(2)])
    stay = decide_on(t.state())
    assert stay["move"] is None and stay["pending"] is False, stay
    unfitted = decide_on(WindowTuner(k=1, j=1, cap=8, tune_k=True, tune_j=False, batch_groups=2,
                                     group_size=4).state())
    assert unfitted["move"] is None and unfitted["pending"] is True

    host = DecisionHost()
    try:
        def cooldown(reply: dict) -> float:
            host.replies.put(dict(reply, decide_s=1.0))
            host.poll()
            return round(host.not_before - host._replied, 6)

        assert [cooldown(stay) for _ in range(5)] == [19.0, 39.0, 79.0, 79.0, 79.0]
        assert cooldown(unfitted) == 9.0 and cooldown(stay) == 19.0
        widening = {"at": [1, 1], "move": [2, 2, "engine idle", 0.1]}
        assert cooldown(widening) == 9.0
        host.taken(widening)
        assert cooldown(stay) == 19.0 and cooldown(stay) == 39.0
        host.moved()  # the drift budget narrowed the window: the next decision after the tenth's cool-down
        assert host.not_before - host._replied == pytest.approx(9.0) and cooldown(stay) == 19.0
        # a decision in flight when the drift budget moved the window judged the old one: its "stay" is no stay
        host.busy = True
        host.moved()
        assert cooldown(stay) == 9.0 and host.stays == 0 and cooldown(stay) == 19.0
    finally:
        host.close()


def test_the_decision_process_moves_the_window_without_holding_the_learners_thread():
    """With the hook's own decision process: moves arrive within a few steps of being due and reach the controller,
    each step records how long the hook held the thread (``time/tune_s``), which is a small share of a decision's
    cost (``tune/decide_s``, measured in the child), while deciding in place holds the thread for the whole
    decision on the steps where one is due."""
    cfg = _auto_cfg()
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    said: list[str] = []
    hook = window_hook(cfg, adm, said.append)
    rng, records, idle = random.Random(0), [], []
    submit = hook.host.submit
    hook.host.submit = lambda state, idle_=False, **kw: (idle.append(kw.get("idle", idle_)), submit(state, **kw))
    try:
        for _ in range(400):
            metrics, groups = _step(rng)
            hook.after_step(metrics, groups)
            assert (metrics["tune/k"], metrics["tune/j"]) == (adm.k, adm.j)
            records.append(metrics)
            if adm.k >= 3:
                break
            time.sleep(0.02)
        assert hook.host is not None and hook.host.decisions >= 1, said  # never fell back
        # the child's nice value: this process's plus NICE (yields to the learner), and Linux's idle class (it runs
        # on what the run leaves idle: tuner_host.py, "Why the idle class")
        assert os.getpriority(os.PRIO_PROCESS, hook.host.proc.pid) == min(19, os.nice(0) + NICE)
        # the first judgement at nice alone, every later one in the idle class (tuner_host.py: "Why the idle class")
        assert idle[0] is False and all(idle[1:]), idle
    finally:
        hook.close()
    assert adm.k >= 3 and hook.changes >= 1 and said and all(line.startswith("window k ") for line in said), said
    decided = [r["tune/decide_s"] for r in records if "tune/decide_s" in r]
    assert len([r["tune/decide_cpu_s"] for r in records if "tune/decide_cpu_s" in r]) == len(decided)
    held = [r["time/tune_s"] for r in records]
    assert decided and max(held) < min(decided), (max(held), min(decided))
    inline = window_hook(cfg, AdmissionController(2, 1, lookahead=None), lambda _l: None, background=False)
    rng, due_held = random.Random(0), []
    for i in range(1, 10):
        metrics, groups = _step(rng)
        inline.after_step(metrics, groups)
        if i % 3 == 0:
            due_held.append(metrics["time/tune_s"])
    assert min(due_held[1:]) > max(held), (due_held, max(held))  # in place, a due step holds the whole decision


def test_a_decision_process_that_dies_leaves_the_hook_deciding_in_place_and_saying_so():
    cfg = _auto_cfg()
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    said: list[str] = []
    hook = window_hook(cfg, adm, said.append)
    hook.host.proc.kill()
    rng = random.Random(0)
    deadline = time.monotonic() + 30
    while hook.host is not None and time.monotonic() < deadline:
        metrics, groups = _step(rng)
        hook.after_step(metrics, groups)
        time.sleep(0.01)
    assert hook.host is None and any("deciding on the learner's thread" in line for line in said), said
    for _ in range(30):  # and goes on tuning, step for step
        metrics, groups = _step(rng)
        hook.after_step(metrics, groups)
    assert adm.k > 1


def test_drift_over_the_budget_narrows_at_once_with_a_decision_process():
    """The budget is the learner's own check (a mean over the last records), not a decision to wait for: on the due
    step itself the window narrows, whatever the decision process is doing."""
    cfg = load_config(["rollout.max_staleness=auto", "rollout.tune_every=3", "rollout.rollout_batch_size=2",
                       "rollout.max_staleness_cap=6", "algorithm.offpolicy_budget=0.01"])
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    said: list[str] = []
    hook = window_hook(cfg, adm, said.append)
    try:
        assert hook.host is not None
        hook.restore({"k": 4, "j": 4})
        rng = random.Random(0)
        for i in range(1, 7):
            metrics, groups = _step(rng)
            metrics["actor/mismatch_kl"] = 0.5
            hook.after_step(metrics, groups)
            assert adm.k == 4 - i // 3, (i, adm.k)  # steps 3 and 6: one step narrower, on that step
            assert (metrics.get("tune/reason") or "drift").startswith("drift")
    finally:
        hook.close()
    assert said[-1].startswith("window k 3 -> 2") and "drift over budget" in said[-1]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's idle scheduling class only")
def test_the_decision_process_enters_the_idle_class_when_asked_and_stays_there():
    cfg = _auto_cfg()
    hook = window_hook(cfg, AdmissionController(2, 1, lookahead=None), lambda _l: None)
    host, rng = hook.host, random.Random(0)
    try:
        for _ in range(3):
            metrics, groups = _step(rng)
            hook.tuner.record(metrics, [g.sample_lengths() for g in groups])

        def policy_after_decision(idle: bool) -> int:
            host.submit(hook.tuner.state(), idle=idle)
            deadline = time.monotonic() + 120
            while (reply := host.poll()) is None:
                assert time.monotonic() < deadline, "no reply"
                time.sleep(0.01)
            assert "error" not in reply, reply
            return os.sched_getscheduler(host.proc.pid)

        assert policy_after_decision(False) == os.SCHED_OTHER  # the first judgement: niced only
        assert policy_after_decision(True) == os.SCHED_IDLE
        assert policy_after_decision(False) == os.SCHED_IDLE  # for good: the child never leaves the class
    finally:
        hook.close()
